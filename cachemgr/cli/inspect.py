"""scan, stats, ls, show: look at the cache. None of these imports torch."""

from __future__ import annotations

import sys

import click

from cachemgr.cli.common import (
    DURATION,
    SIZE,
    age,
    emit_json,
    human_size,
    ingest_spool,
    json_option,
    pass_app,
    progress_bar,
    short,
    table,
)
from cachemgr.errors import NotFound
from cachemgr.layout import KINDS


def run_scan(app, quiet_progress: bool = False, full: bool = False):
    import os
    import time

    from cachemgr.index.result import ScanResult, check_root

    s = app.settings
    root = s.cache_dir
    if s.sources["cache_dir"] == "default" and not os.path.exists(root):
        # Inductor's default directory appears with the first compile: nothing to index yet.
        # A directory the user named (flag, env, config) that is missing stays an error.
        click.echo(f"cachemgr: {root} does not exist yet (nothing compiled on this host); index is empty", err=True)
        return ScanResult(root)
    check_root(root)
    result = None
    if s.db.startswith("sqlite:///") and not full:  # nothing changed? answered without SQLAlchemy
        from cachemgr.index.queries import rescan_fast
        from cachemgr.index.revision import HEAD_REVISION

        t0 = time.monotonic()
        unchanged = rescan_fast(s.db[len("sqlite:///"):], HEAD_REVISION, s.host, root)
        if unchanged is not None:
            result = ScanResult(root, unchanged=unchanged, seconds=time.monotonic() - t0)
    if result is None:
        from cachemgr.index.scan import reconcile

        with progress_bar("parsing entries", enabled=None if not quiet_progress else False) as progress:
            result = reconcile(app.db, app.cache_id, root, progress=progress, full=full)
    ingest_spool(app)
    return result


@click.command()
@click.option("--full", is_flag=True,
              help="Read every directory and stat every file, even where a directory's mtime says nothing "
                   "changed (for file systems without reliable directory mtimes, or files rewritten in place).")
@json_option
@pass_app
def scan(app, full: bool, as_json: bool) -> None:
    """Reconcile the index with the cache directory and print what changed.

    New and changed entries are parsed (without importing torch); removed ones leave the index.
    A rescan reads only the directories whose mtime moved since the last scan (torch writes every
    cache file by renaming it into place, which moves its directory's mtime), so an unchanged tree
    costs a stat per directory. Corrupt entries are reported, never fatal.

    \b
    Example:
        cachemgr --cache-dir /var/cache/inductor scan
        cachemgr scan --json | jq .added
        cachemgr scan --full             # stat every file, trust no directory mtime
    """
    r = run_scan(app, full=full)
    if as_json:
        emit_json(r.as_dict())
        return
    click.echo(f"scanned {r.root}: {len(r.added)} added, {len(r.changed)} changed, {len(r.removed)} removed, "
               f"{r.unchanged} unchanged ({r.seconds:.2f} s)")
    for key, reason in r.corrupt:
        click.echo(f"corrupt: {key}: {reason}", err=True)
    for d in r.unreadable:
        click.echo(f"cachemgr: warning: cannot read {d or '.'}/ under {r.root}: its entries are kept as last "
                   "indexed", err=True)


@click.command()
@click.option("--window", type=DURATION, default="1d", show_default=True,
              help="Window for the activity figures (hit ratio, recompilations, compile time).")
@click.option("--fleet", "fleet", is_flag=True,
              help="Every host and cache in the index (a shared PostgreSQL index), summed, without scanning.")
@json_option
@pass_app
def stats(app, window: float, fleet: bool, as_json: bool) -> None:
    """Totals of the index: entries, files and bytes by kind, and recent activity.

    `bytes` is the sum of st_size of every regular file in the index, so after a scan it agrees
    with `find ROOT -type f -printf '%s\\n'` summed. A cache never scanned is scanned first.
    With --fleet: the totals of every cache of every host, and each one's own line.

    \b
    Example:
        cachemgr stats
        cachemgr stats --json --window 6h | jq .activity.hit_ratio
        cachemgr --db postgresql+psycopg://root@127.0.0.1/test stats --fleet
    """
    if fleet:
        _fleet_stats(app, window, as_json)
        return
    doc = _stats(app, window)
    if as_json:
        emit_json(doc)
        return
    rows = [(k, v["entries"], v["files"], human_size(v["bytes"])) for k, v in doc["by_kind"].items() if v["entries"]]
    rows.append(("total", doc["entries"], doc["files"], human_size(doc["bytes"])))
    click.echo(f"cache {doc['cache_dir']}")
    table(("kind", "entries", "files", "bytes"), rows)
    a = doc["activity"]
    ratio = "-" if a["hit_ratio"] is None else f"{a['hit_ratio']:.1%}"
    click.echo(f"corrupt {doc['corrupt']}, pinned {doc['pinned']}, oldest {doc['oldest'] or '-'}, "
               f"newest {doc['newest'] or '-'}")
    click.echo(f"last {window / 3600:g}h: hit ratio {ratio} ({a['hits']} hits, {a['compiles']} compiles), "
               f"{a['recompilations']} recompilations, {a['compile_seconds']:.1f} s compiling, "
               f"{a['evictions']} evictions")


def _fleet_stats(app, window: float, as_json: bool) -> None:
    from cachemgr.fleet.report import fleet_stats

    with app.db.engine.connect() as conn:
        doc = fleet_stats(conn, window)
    if as_json:
        emit_json(doc)
        return
    rows = [(c["host"], c["cache_dir"], c["entries"], c["files"], human_size(c["bytes"]), c["last_scan"] or "-")
            for c in doc["caches"]]
    rows.append((f"total ({len(doc['hosts'])} hosts)", "", doc["entries"], doc["files"], human_size(doc["bytes"]), ""))
    table(("host", "cache dir", "entries", "files", "bytes", "last scan"), rows, title="fleet")
    a = doc["activity"]
    ratio = "-" if a["hit_ratio"] is None else f"{a['hit_ratio']:.1%}"
    click.echo(f"last {window / 3600:g}h: hit ratio {ratio} ({a['hits']} hits, {a['compiles']} compiles), "
               f"{a['evictions']} evictions; corrupt {doc['corrupt']}, pinned {doc['pinned']}")


def _stats(app, window: float) -> dict:
    s = app.settings
    if s.db.startswith("sqlite:///"):  # fast path: stdlib sqlite3, no SQLAlchemy import
        from cachemgr.index.queries import stats_fast
        from cachemgr.index.revision import HEAD_REVISION

        doc = stats_fast(s.db[len("sqlite:///"):], HEAD_REVISION, s.host, s.cache_dir, window)
        if doc is not None:
            return doc
    from cachemgr.index.queries import stats as stats_query

    cid = app.cache_id
    with app.db.engine.connect() as conn:
        doc = stats_query(conn, s.host, s.cache_dir, window)
    if doc is None or doc["last_scan"] is None:
        click.echo(f"cachemgr: {s.cache_dir} was never scanned; scanning it now", err=True)
        run_scan(app)
        with app.db.engine.connect() as conn:
            doc = stats_query(conn, s.host, s.cache_dir, window)
    assert doc is not None and cid
    return doc


@click.command(name="ls")
@click.option("--kind", type=click.Choice(KINDS), help="Only entries of this kind.")
@click.option("--older-than", type=DURATION, help="Only entries not accessed for this long (14d, 6h, 30m).")
@click.option("--larger-than", type=SIZE, help="Only entries larger than this (500MB, 1GiB).")
@click.option("--graph", metavar="KEY", help="Only the entries of this graph key.")
@click.option("--pinned", is_flag=True, help="Only pinned entries.")
@click.option("--corrupt", is_flag=True, help="Only corrupt entries.")
@click.option("--sort", type=click.Choice(["size", "age", "cost"]), default="size", show_default=True,
              help="size: largest first; age: least recently used first; cost: longest compile first.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many entries.")
@click.option("--host", "on_host", metavar="H", help="Entries of host H (every cache it has in a shared index).")
@json_option
@pass_app
def ls(app, kind, older_than, larger_than, graph, pinned, corrupt, sort, limit, on_host, as_json) -> None:
    """List index entries, filtered and sorted.

    \b
    Example:
        cachemgr ls --kind fxgraph --sort cost --limit 10
        cachemgr ls --older-than 14d --larger-than 100MB --json
        cachemgr --db postgresql+psycopg://root@127.0.0.1/test ls --host gpu-07 --limit 20
    """
    from cachemgr.index.queries import Filters, list_entries

    f = Filters(kind=kind, older_than=older_than, larger_than=larger_than, graph=graph, pinned=pinned,
                corrupt=corrupt, sort=sort, limit=limit)
    with app.db.engine.connect() as conn:
        if on_host is None:
            rows = list_entries(conn, app.cache_id, f)
        else:
            rows = _host_entries(conn, on_host, f)
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no entries match" + ("" if any((kind, older_than, larger_than, graph, pinned, corrupt))
                                         else f" (is {app.settings.cache_dir} scanned? run: cachemgr scan)"))
        return
    cut = 44 if sys.stdout.isatty() else None  # piped: whole keys, to paste into show or pin
    table(("key", "kind", "bytes", "idle", "hits", "compile", "signature"), [
        (short(r["key"], cut) + (" [pin]" if r["pinned"] else "") + (" [corrupt]" if r["corrupt"] else ""),
         r["kind"], human_size(r["bytes"]), age(r["last_access"]), r["hit_count"],
         "" if r["compile_seconds"] is None else f"{r['compile_seconds']:.2f}s", short(r["signature"], 40))
        for r in rows
    ])


def _host_entries(conn, host: str, f) -> list[dict]:
    """ls over every cache of one host, in the order list_entries sorts by."""
    from sqlalchemy import select

    from cachemgr.index.models import Cache
    from cachemgr.index.queries import list_entries

    caches = conn.execute(select(Cache.id, Cache.root).where(Cache.host == host).order_by(Cache.root)).fetchall()
    if not caches:
        raise NotFound(f"no host {host!r} in the index (see: cachemgr stats --fleet)")
    rows = [{**r, "host": host, "cache_dir": root} for cid, root in caches for r in list_entries(conn, cid, f)]
    if len(caches) > 1:
        order = {"size": lambda r: -r["bytes"], "age": lambda r: r["last_access"],
                 "cost": lambda r: -(r["compile_seconds"] if r["compile_seconds"] is not None else float("-inf"))}
        rows.sort(key=order[f.sort])
    return rows[: f.limit] if f.limit else rows


@click.command()
@click.argument("key")
@json_option
@pass_app
def show(app, key: str, as_json: bool) -> None:
    """One entry in full, with the files that belong to it.

    KEY is an entry key (as `ls` prints it), a graph key (every entry of that graph), or a
    unique prefix of an entry key.

    \b
    Example:
        cachemgr show fxgraph/gv/fgv4ud3t.../scbmvvaa...
        cachemgr show fgv4ud3tijkbzc4tbcqhirql64dqih532zwb4egaukwwkig3de4n --json
    """
    from cachemgr.index.queries import entry_detail, find_entries

    with app.db.engine.connect() as conn:
        rows = find_entries(conn, app.cache_id, key)
        if not rows:
            raise NotFound(f"no entry {key!r} in the index of {app.settings.cache_dir} (try: cachemgr ls)")
        docs = [entry_detail(conn, app.settings.cache_dir, app.cache_id, r) for r in rows]
    if as_json:
        emit_json(docs[0] if len(docs) == 1 else docs)
        return
    for d in docs:
        for field in ("key", "kind", "bytes", "files", "hit_count", "pinned", "pin_reason", "graph_key", "signature",
                      "signature_hash", "options_hash", "guards", "device_types", "compile_seconds",
                      "torch_version", "corrupt"):
            if d[field] not in (None, ""):
                value = human_size(d[field]) if field == "bytes" else d[field]
                click.echo(f"{field + ':':17} {value}")
        click.echo(f"{'last_access:':17} {age(d['last_access'])} ago")
        click.echo(f"{'components:':17} {d['components']}")
        for f in d["files_on_disk"]:
            click.echo(f"  file  {f['path']}  {human_size(f['bytes'])}")
        for r in d["references"]:
            click.echo(f"  needs {r['kind']} {r['ref']}" + ("" if r["present"] else "  (missing)"))
        for k in d["referenced_by"]:
            click.echo(f"  used by {k}")
        click.echo()


COMMANDS = (scan, stats, ls, show)
