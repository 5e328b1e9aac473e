"""scan, stats, ls, show: look at the cache. None of these imports torch."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import click

from cachemgr.cli.common import (
    COUNT,
    DURATION,
    KEY,
    SIZE,
    Col,
    age,
    clean,
    emit_json,
    exit_codes,
    fields_block,
    human_size,
    ingest_spool,
    json_option,
    model_option,
    pass_app,
    plural,
    progress_bar,
    quiet_option,
    say,
    seconds,
    table,
    wide_option,
)
from cachemgr.errors import UsageError
from cachemgr.layout import KINDS
from cachemgr.units import format_duration
from cachemgr.vocab import LOSS, PICKLED, Held, Kind


def run_scan(app, quiet_progress: bool = False, full: bool = False):
    from cachemgr.index.result import ScanResult, check_root
    from cachemgr.index.revision import HEAD_REVISION
    from cachemgr.index.store import rescan_unchanged, sqlite_path

    s = app.settings
    root = s.cache_dir
    if s.defaulted("cache_dir") and not os.path.exists(root):
        # Inductor's default directory appears with the first compile: nothing to index yet.
        # A directory named for cachemgr (flag, CACHEMGR_ env, config) that is missing stays an error.
        click.echo(
            f"cachemgr: {clean(root)} does not exist yet (nothing compiled on this host); index is empty", err=True
        )
        return ScanResult(root)
    check_root(root)
    result = None
    path = sqlite_path(s.db)
    if path is not None and not full:  # nothing changed? answered without SQLAlchemy
        t0 = time.monotonic()
        result = rescan_unchanged(path, HEAD_REVISION, s.host, root)
        if result is not None:
            result = replace(result, seconds=time.monotonic() - t0)
    if result is None:
        from cachemgr.index.workers import Pool

        with Pool() as pool, progress_bar("parsing entries", enabled=None if not quiet_progress else False) as progress:
            if path is not None and not full:  # a first scan? both phases without SQLAlchemy too
                from cachemgr.index.fill import first_scan

                result = first_scan(path, s.host, root, pool, s.defaulted("db"), progress)
            if result is None:
                from cachemgr.index import reconcile

                result = reconcile(app.db, app.cache_id, root, progress=progress, full=full, pool=pool)
    ingest_spool(app)
    return result


def _ago(ts: float | None) -> str:
    """'5m ago', or 'unknown' (a time no clock gives, from an index edited by hand)."""
    shown = age(ts)
    return "unknown" if shown == "-" else f"{shown} ago"


def scanned_store(app):
    """The index of this cache, scanned first if it never was (a missing cache dir: exit 4).
    On the embedded SQLite index of a scanned cache, read without SQLAlchemy."""
    store = app.quick_store()
    if store is not None:
        return store
    if not app.store.scanned():
        if os.path.isdir(app.settings.cache_dir):
            click.echo(f"cachemgr: {clean(app.settings.cache_dir)} was never scanned; scanning it now", err=True)
        run_scan(app)
    return app.store


@click.command()
@click.option(
    "--full",
    is_flag=True,
    help="Read every directory and stat every file, even where a directory's mtime says nothing "
    "changed (for file systems without reliable directory mtimes, or files rewritten in place).",
)
@json_option
@pass_app
@exit_codes(0, 2, 4, 5)
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
        cachemgr scan --full             # stat every file (trusts no mtime)
    """
    r = run_scan(app, full=full)
    if as_json:
        emit_json(r.as_dict())
        return
    click.echo(
        f"scanned {clean(r.root)}: {r.added} added, {r.changed} changed, {r.removed} removed, "
        f"{r.unchanged} unchanged ({r.seconds:.2f} s)"
    )
    for key, reason in r.corrupt:
        say(f"corrupt: {key}: {reason}", err=True)  # (wrapped to the terminal; the key whole)
    for d in r.unreadable:
        say(
            f"cachemgr: warning: cannot read {d or '.'}/ under {r.root}: its entries are kept as last indexed",
            True,
        )
    for d in r.mounted:
        say(
            f"cachemgr: warning: {d}/ under {r.root} is a mount point (another file system's): not indexed",
            True,
        )


# -- stats ------------------------------------------------------------------------------------------


@click.command()
@click.option(
    "--window",
    type=DURATION,
    default="1d",
    show_default=True,
    help="Window for the activity figures (hits, compiles, recompiles, compile time).",
)
@click.option(
    "--by",
    type=click.Choice(["kind", "model"]),
    default="kind",
    show_default=True,
    help="kind: bytes by entry kind; model: by recorded model (cachemgr.record), with what its graphs need.",
)
@click.option(
    "--fleet",
    "fleet",
    is_flag=True,
    help="Every host and cache in the index (a shared PostgreSQL index), summed, without scanning.",
)
@json_option
@pass_app
@exit_codes(0, 2, 4, 5)
def stats(app, window: float, by: str, fleet: bool, as_json: bool) -> None:
    """How full the cache is against its limits, where its index lives, and recent activity.

    Usage is shown against each configured limit (max_size, max_files, min_free, max_age) as
    `ccache -s` does. `bytes` is the sum of st_size of every regular file in the index, so after
    a scan it agrees with `find ROOT -type f -printf '%s\\n'` summed. A compile is a new fxgraph
    entry (a cache miss); a recompile, a compile of a graph compiled before in another form (as
    `explain` tells them); a hit, a read of one; entries `cachemgr import` wrote are loaded, not
    compiled. A cache never scanned is scanned first.

    \b
    Example:
        cachemgr stats
        cachemgr stats --by model
        cachemgr stats --json --window 6h | jq .activity.hit_ratio
        cachemgr --db postgresql+psycopg://root@127.0.0.1/test stats --fleet
    """
    if fleet:
        if by != "kind":
            raise UsageError("--by model is per cache: not with --fleet")
        _fleet_stats(app, window, as_json)
        return
    from cachemgr import explain

    store = scanned_store(app)
    totals = store.totals()
    act = explain.activity(store, window)
    s = app.settings
    limits = _limits(store, totals, s)
    doc = {
        **totals.as_dict(),
        "index": _index_doc(s),
        "policy": s.policy,
        "low_water": s.low_water,
        "grace_seconds": s.grace,
        "limits": limits,
        "activity": act.as_dict(),
    }
    models = store.model_usage() if by == "model" else None
    if models is not None:
        doc["by_model"] = [m.as_dict() for m in models]
    if as_json:
        emit_json(doc)
        return
    _print_stats(doc, totals, act, models)


def _index_doc(s) -> dict:
    from cachemgr.index.store import sqlite_path

    path = sqlite_path(s.db)
    if path is not None:  # (no SQLAlchemy for the embedded index: stats runs without it)
        size = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.isfile(p))
        return {"url": s.db, "path": path, "bytes": size, "source": s.sources["db"]}
    from cachemgr.config import redact_url

    return {"url": redact_url(s.db), "path": None, "bytes": None, "source": s.sources["db"]}


def _limits(store, totals, s) -> dict:
    """Each configured limit and the cache's use of it."""
    from cachemgr.units import parse_size_or_percent

    t = totals.total
    out: dict = {}

    def used(value: int, limit: int | None) -> dict:
        return {"used": value, "limit": limit, "percent": None if not limit else round(100 * value / limit, 1)}

    out["max_size"] = used(t.bytes, s.max_size)
    out["max_files"] = used(t.files, s.max_files)
    free = None
    try:
        st = os.statvfs(s.cache_dir)
        free = {"free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}
    except OSError:
        pass
    floor = None
    if s.min_free and free:
        size, pct = parse_size_or_percent(s.min_free)
        floor = size if size is not None else int((pct or 0.0) * free["total"])
    out["min_free"] = {"limit": s.min_free, "floor_bytes": floor, **(free or {"free": None, "total": None})}
    idle = store.idle_usage(s.max_age) if s.max_age is not None else None
    out["max_age"] = {
        "limit_seconds": s.max_age,
        "idle_entries": idle.entries if idle else None,
        "idle_bytes": idle.bytes if idle else None,
    }
    return out


def _print_stats(doc: dict, totals, act, models) -> None:
    lim, t = doc["limits"], totals.total
    size, files, free, max_age = lim["max_size"], lim["max_files"], lim["min_free"], lim["max_age"]

    def against(value: str, x: dict, name: str, total: str) -> str:
        if x["limit"] is None:
            return f"{value} (no {name})"
        return f"{value} of {total} ({x['percent']:g}%)"

    free_text = "-"
    if free["free"] is not None:
        free_text = (
            f"{human_size(free['free'])} of {human_size(free['total'])} "
            f"({100 * free['free'] / max(1, free['total']):.0f}%)"
        )
        free_text += (
            f"; min_free {free['limit']}"
            + (f" ({human_size(free['floor_bytes'])})" if free["limit"] and not free["limit"].endswith("B") else "")
            if free["limit"]
            else " (no min_free)"
        )
    age_text = "(no max_age)"
    if max_age["limit_seconds"] is not None:
        age_text = (
            f"{format_duration(max_age['limit_seconds'])}: {plural(max_age['idle_entries'], 'entry')} "
            f"({human_size(max_age['idle_bytes'])}) idle longer"
        )
    index = doc["index"]
    where = index["path"] or index["url"]
    if index["bytes"] is not None:
        where += f" ({human_size(index['bytes'])})"
    ratio = "-" if act.hit_ratio is None else f"{act.hit_ratio:.1%}"
    state = ", ".join(
        x
        for x in (
            f"{totals.corrupt} corrupt" if totals.corrupt else "",
            f"{totals.pending:,} not parsed yet" if totals.pending else "",
            plural(totals.pinned, "pin") if totals.pinned else "",
        )
        if x
    )
    for line in fields_block(
        [
            ("cache", doc["cache_dir"]),
            ("index", where),
            ("last scan", "never" if totals.last_scan is None else f"{age(totals.last_scan)} ago"),
            (
                "policy",
                f"{doc['policy']}; evicts down to {doc['low_water']:.0%} of a limit; grace "
                f"{format_duration(doc['grace_seconds'])}",
            ),
            ("size", against(human_size(t.bytes), size, "max_size", human_size(size["limit"]))),
            ("files", against(f"{t.files:,}", files, "max_files", f"{files['limit'] or 0:,}")),
            ("free space", free_text),
            ("max age", age_text),
            ("entries", f"{t.entries:,}" + (f" ({state})" if state else "")),
            (
                f"last {format_duration(act.window)}",
                f"{plural(act.compiles, 'compile')} ({plural(act.recompiles, 'recompile')}), "
                f"{plural(act.hits, 'hit')}, {act.loaded:,} loaded: hit ratio {ratio}",
            ),
            ("", f"{act.compile_seconds:.1f} s compiling, {plural(act.evictions, 'eviction')}"),
        ]
    ):
        click.echo(line)
    click.echo()
    if models is not None:
        if not models:
            click.echo("no recorded models (record them with cachemgr.record; see: cachemgr shapes)")
            return
        table(
            [
                Col("model", cut=True),
                Col("shapes", True),
                Col("graphs", True),
                Col("entries", True),
                Col("bytes", True),
                Col("hits", True),
                Col("compile", True),
                Col("last used", True),
            ],
            [
                (
                    m.model,
                    m.signatures,
                    m.graphs,
                    m.entries,
                    human_size(m.bytes),
                    m.hits,
                    seconds(m.compile_seconds),
                    age(m.last_access),
                )
                for m in models
            ],
        )
        return
    rows = [(k, f"{u.entries:,}", f"{u.files:,}", human_size(u.bytes)) for k, u in totals.by_kind.items() if u.entries]
    rows.append(("total", f"{t.entries:,}", f"{t.files:,}", human_size(t.bytes)))
    table([Col("kind"), Col("entries", True), Col("files", True), Col("bytes", True)], rows)


def _fleet_stats(app, window: float, as_json: bool) -> None:
    from cachemgr.fleet.report import fleet_stats

    doc = fleet_stats(app.index_store, window)
    if as_json:
        emit_json(doc)
        return
    rows = [
        (
            c["host"],
            f"{c['entries']:,}",
            f"{c['files']:,}",
            human_size(c["bytes"]),
            age(c["last_scan_ts"]),
            c["cache_dir"],
        )
        for c in doc["caches"]
    ]
    rows.append(
        (
            "total",
            f"{doc['entries']:,}",
            f"{doc['files']:,}",
            human_size(doc["bytes"]),
            "",
            f"{plural(len(doc['hosts']), 'host')}, {plural(len(doc['caches']), 'cache')}",
        )
    )
    table(
        [
            Col("host", cut=True, min=12),
            Col("entries", True),
            Col("files", True),
            Col("bytes", True),
            Col("scanned", True),
            Col("cache dir", cut=True),
        ],
        rows,
    )
    a = doc["activity"]
    ratio = "-" if a["hit_ratio"] is None else f"{a['hit_ratio']:.1%}"
    say(
        f"last {format_duration(window)}: {plural(a['hits'], 'hit')}, {plural(a['compiles'], 'compile')} "
        f"({plural(a['recompiles'], 'recompile')}), {a['loaded']:,} loaded; hit ratio {ratio}; "
        f"{plural(a['evictions'], 'eviction')}; {doc['corrupt']} corrupt, {plural(doc['pinned'], 'pin')}"
    )


# -- ls -----------------------------------------------------------------------------------------------


def graph_filter(app, store, graph: str | None, model: str | None) -> frozenset[str] | None:
    """The graph keys --graph KEY (any key form) or --model NAME name; None: no such filter."""
    if graph and model:
        raise UsageError("give --graph or --model, not both")
    if graph:
        return frozenset({store.resolve(graph).graph})
    if model:
        return frozenset(store.model_graphs(model, "--graph KEY"))
    return None


def entry_note(e) -> str:
    """What `ls` says in the signature column: the signature, or why there is none."""
    if e.corrupt:
        return f"corrupt: {e.corrupt}"
    if not e.parsed:
        return "not parsed yet"
    note = e.signature or ("not recorded" if e.unrecorded and e.kind == Kind.FXGRAPH else "")
    return f"pinned; {note}" if e.pinned and note else ("pinned" if e.pinned else note)


@click.command(name="ls")
@click.option(
    "--kind", type=click.Choice(KINDS), metavar="KIND", help=f"Only entries of this kind: {', '.join(KINDS)}."
)
@click.option("--older-than", type=DURATION, help="Only entries not accessed for this long (14d, 6h, 30m).")
@click.option("--larger-than", type=SIZE, help="Only entries larger than this (500MB, 1GiB).")
@click.option("--graph", type=KEY, metavar="KEY", help="Only the entries of this graph (any key form of it).")
@model_option
@click.option("--pinned", is_flag=True, help="Only pinned entries.")
@click.option("--corrupt", is_flag=True, help="Only corrupt entries.")
@click.option(
    "--sort",
    type=click.Choice(["size", "age", "cost", "name"]),
    default="size",
    show_default=True,
    help="size: largest first; age: least recently used first; cost: longest compile first; name: by key.",
)
@click.option("--limit", type=COUNT, help="At most this many entries.")
@click.option("--host", "on_host", metavar="H", help="Entries of host H (every cache it has in a shared index).")
@quiet_option
@wide_option
@json_option
@pass_app
@exit_codes(0, 2, 3, 4, 5)
def ls(
    app, kind, older_than, larger_than, graph, model, pinned, corrupt, sort, limit, on_host, quiet, wide, as_json
) -> None:
    """List index entries, filtered and sorted, with a short key for each.

    Keys are shown short, as git abbreviates commits (the shortest unique prefix, 8 characters
    or more); every command takes them, and the whole keys --wide prints. Inductor's lock files
    (empty) are left out of the table and of -q unless --kind lock; --json lists every entry.

    \b
    Example:
        cachemgr ls --kind fxgraph --sort cost --limit 10
        cachemgr ls --older-than 14d --larger-than 100MB --json
        cachemgr ls --model ranker -q | xargs -n1 cachemgr pin
        cachemgr --db postgresql+psycopg://db/cachemgr ls --host gpu-07 --limit 20
    """
    from cachemgr.index import Filters

    f = Filters(
        kind=kind,
        older_than=older_than,
        larger_than=larger_than,
        pinned=pinned,
        corrupt=corrupt,
        sort=sort,
        limit=limit,
    )
    if on_host is not None:
        if graph or model:
            raise UsageError("--graph and --model name graphs of this cache: not with --host")
        listed = _host_entries(app, on_host, replace(f, locks=as_json))
    else:
        store = scanned_store(app)
        rows = store.entries(replace(f, graphs=graph_filter(app, store, graph, model), locks=as_json))
        shorts = store.short_keys(rows)
        listed = [(e, shorts[e.key], None) for e in rows]
    if as_json:
        emit_json(
            [
                {**e.as_dict(), "short": s, **({"host": on_host, "cache_dir": root} if on_host else {})}
                for e, s, root in listed
            ]
        )
        return
    shown = [(e, e.key if wide else s) for e, s, _ in listed]
    if quiet:
        for _, key in shown:
            click.echo(clean(key))
        return
    if not shown:
        filtered = any(x not in (None, False) for x in (kind, older_than, larger_than, graph, model, pinned, corrupt))
        click.echo("no entries match" if filtered else f"no entries in the index of {clean(app.settings.cache_dir)}")
    else:
        table(
            [Col("key"), Col("kind"), Col("bytes", True), Col("idle", True), Col("hits", True), Col("compile", True)]
            + ([Col("torch")] if wide else [])
            + [Col("signature", cut=True)],
            [
                (
                    key,
                    e.kind,
                    human_size(e.bytes),
                    age(e.last_access),
                    f"{e.hit_count:,}",
                    "" if e.compile_seconds is None else seconds(e.compile_seconds),
                )
                + ((e.torch_version or "",) if wide else ())
                + (entry_note(e),)
                for e, key in shown
            ],
            wide=wide,
        )
        more = f"; the first {limit} (--limit)" if limit is not None and len(shown) == limit else ""
        click.echo(f"{plural(len(shown), 'entry')}, {human_size(sum(e.bytes for e, _ in shown))}{more}")
    if pinned and on_host is None:
        _print_unmatched_pins(store)


def _print_unmatched_pins(store) -> None:
    lost = [p for p in store.pins() if not p.entries]
    if lost:
        click.echo(f"pinned, not in the index ({plural(len(lost), 'key')}; see: cachemgr pin):")
        for p in lost:
            click.echo(f"  {clean(p.key)}" + (f"  ({clean(p.reason)})" if p.reason else ""))


def _host_entries(app, host: str, f) -> list[tuple]:
    """(entry, short key, cache dir) over every cache of one host, in the order `ls` sorts by."""
    from cachemgr.errors import NotFound
    from cachemgr.index.store import SORT_KEYS

    index = app.index_store
    caches = index.caches(host)
    if not caches:
        raise NotFound(f"no host {host!r} in the index (see: cachemgr stats --fleet)")
    out: list[tuple] = []
    for c in caches:
        store = index.on(c)
        rows = store.entries(f)
        shorts = store.short_keys(rows)
        out.extend((e, shorts[e.key], c.root) for e in rows)
    if len(caches) > 1:
        out.sort(key=lambda x: SORT_KEYS[f.sort](x[0]))
    return out[: f.limit] if f.limit else out


# -- show ---------------------------------------------------------------------------------------------


@click.command()
@click.argument("key", type=KEY)
@wide_option
@json_option
@pass_app
@exit_codes(0, 2, 3, 4, 5)
def show(app, key: str, wide: bool, as_json: bool) -> None:
    """One entry in full, with the files that belong to it, what losing it costs and what
    eviction would do with it now.

    KEY is any key a command prints: an entry key, a graph key (every entry of that graph), a
    short key, or a unique prefix of any of these (one that begins with '-' goes after `--`:
    `cachemgr show -- -odd-name`).

    `if lost` says what torch must redo without the entry (read off torch's source, per kind).
    `eviction` is what `cachemgr evict --dry-run` would do with it now under the configured
    limits (max_size, max_age, max_files, min_free, grace, policy; from the config file and
    CACHEMGR_* environment): "would be evicted now: <reason>", "kept: <reason>" (pinned, used
    within the grace period, a lock held, ...) or "not planned: <why>" when no limit takes it.
    Nothing is locked, scanned or deleted to tell. --json: `loss` and `eviction` {verdict,
    reason, by, by_short (the entry whose keep rule holds it, when another: for "pinned", the
    pinned entry whose pin keeps its group)}.

    --json prints one object for any KEY: the entry's fields (a graph's newest entry where KEY
    names several) and `entries`, every entry KEY names (newest first), each such fields.
    `files_on_disk` lists an entry's files as they are now, at most 1,000 of them (a kernel
    folder may hold millions); `files_not_listed` counts the rest.

    \b
    Example:
        cachemgr show fgv4ud3t
        cachemgr show fxgraph/gv/fgv4ud3t.../scbmvvaa... --json
        CACHEMGR_MAX_SIZE=20GiB cachemgr show fgv4ud3t
    """
    from cachemgr.cli.evict import entry_fates

    store = scanned_store(app)
    match = store.resolve(key)
    shorts = store.short_keys(match.entries)
    fates = entry_fates(app, [e.key for e in match.entries])
    docs = [_detail(app, store, e, shorts[e.key], fates[e.key]) for e in match.entries]
    if as_json:  # one shape, however many entries KEY names
        emit_json({**docs[0], "entries": docs})
        return
    if match.ref is not None and len(docs) > 1:
        click.echo(f"{clean(key)} names {plural(len(docs), 'entry')} of {match.ref}:\n")
    for e, d in zip(match.entries, docs, strict=True):
        for line in _show_lines(e, d, wide):
            click.echo(line)
        click.echo()


def _detail(app, store, e, short: str, fate) -> dict:
    d = {**e.as_dict(), "short": short, "first_seen": e.first_seen, "loss": LOSS.get(e.kind)}
    by = store.entry_by_key(fate.by) if fate.by else None
    d["eviction"] = {**fate.as_dict(), "by_short": store.short_keys([by])[by.key] if by else fate.by}
    d["files_on_disk"], d["files_not_listed"] = _files_on_disk(app.settings.cache_dir, e)
    d["references"] = store.references(e)
    users = store.referenced_by(e)
    d["referenced_by"] = [u.key for u in users]
    d["referenced_by_short"] = list(store.short_keys(users).values())
    d["components"] = store.component_count(e)
    return d


def _files_on_disk(root: str, e) -> tuple[list[dict], int]:
    """The entry's files as they are now ({path, bytes}, by path), and how many more it has than
    are listed (at most layout.MAX_PATHS are: a hostile kernel folder may hold millions)."""
    from cachemgr import layout, safefs

    listed = []
    try:
        with safefs.Root(root) as opened:
            found = layout.stat_entry(opened, layout.Classified(e.kind, e.key, e.ref))
            for p in sorted(found.paths) if found else ():
                try:
                    listed.append({"path": p, "bytes": opened.lstat(layout.fs_path(p)).st_size})
                except OSError:
                    continue  # gone since
    except OSError:
        return [], 0
    return listed, max(0, found.files - len(listed)) if found else 0


def _show_lines(e, d: dict, wide: bool) -> list[str]:
    pending = "not parsed yet" if not e.parsed else None
    torch = e.torch_version or (
        f"not named (build hash {e.torch_version_hash[:12]})" if e.torch_version_hash else pending
    )
    parsed_kind = e.kind in PICKLED
    files = d["files_on_disk"]
    prefix = e.key.rstrip("/") + "/"
    file_names = [(f["path"][len(prefix) :] if f["path"].startswith(prefix) else f["path"], f["bytes"]) for f in files]
    pairs = [
        ("key", e.key),
        ("short key", d["short"]),
        ("kind", e.kind),
        ("bytes", f"{human_size(e.bytes)} ({e.bytes:,} bytes) in {plural(e.files, 'file')}"),
        ("graph key", e.graph_key or (pending if e.kind == Kind.FXGRAPH else None)),
        ("signature", e.signature or (pending if parsed_kind else None)),
        ("guards", e.guards),
        ("devices", e.device_types),
        ("compile time", seconds(e.compile_seconds) if e.compile_seconds is not None else pending),
        ("torch", torch if parsed_kind else None),
        ("options hash", e.options_hash),
        ("not recorded", e.unrecorded),
        ("corrupt", e.corrupt),
        ("pinned", (f"yes, as {e.pin}" + (f": {e.pin_reason}" if e.pin_reason else "")) if e.pinned else None),
        ("hits", f"{e.hit_count:,}, last used {_ago(e.last_access)}"),
        ("written", _ago(e.mtime)),
        ("components", f"{d['components']:,} hash components" if e.kind == Kind.FXGRAPH and e.parsed else None),
        ("if lost", d["loss"]),
        ("eviction", _fate_text(d["eviction"])),
    ]
    unlisted = d["files_not_listed"]
    if wide:
        pairs += [("file", f"{name}  {human_size(n)}") for name, n in file_names]
        if unlisted:
            pairs.append(("file", f"... and {unlisted:,} more, not listed"))
        pairs += [
            ("needs", f"{r['kind']} {r['ref']}" + ("" if r["present"] else "  (not in the index)"))
            for r in d["references"]
        ]
        pairs += [("used by", k) for k in d["referenced_by"]]
    else:
        if len(files) > 1 or (files and file_names[0][0] != files[0]["path"]):
            more = len(files) + unlisted - 6
            pairs.append(
                (
                    "files",
                    ", ".join(f"{name} ({human_size(n)})" for name, n in file_names[:6])
                    + (f" and {more:,} more (--wide)" if more > 0 else ""),
                )
            )
        pairs.append(("needs", _needs_text(d["references"])))
        users = d["referenced_by_short"]
        more = f" and {len(users) - 6} more (--wide)" if len(users) > 6 else ""
        pairs.append(("used by", ", ".join(users[:6]) + more))
    return fields_block(pairs, wrap=not wide, whole=("graph key", "file", "needs", "used by"))


def _fate_text(fate: dict) -> str:
    """'would be evicted now: size', 'kept: grace (with f3sutfpk, which needs it)', 'kept: pinned
    (by the pin of c3tty2wz)', ..."""
    by = fate["by_short"]
    if by and fate["reason"] == Held.PINNED:
        return f"{fate['verdict']}: {fate['reason']} (by the pin of {by})"
    return f"{fate['verdict']}: {fate['reason']}" + (f" (with {by}, which needs it)" if by else "")


def _needs_text(refs: list[dict]) -> str:
    """'62 triton kernels, 28 code entries (26 not in the index)'."""
    by_kind: dict[str, list[dict]] = {}
    for r in refs:
        by_kind.setdefault(r["kind"], []).append(r)
    parts = []
    for kind, rs in by_kind.items():
        missing = sum(1 for r in rs if not r["present"])
        parts.append(f"{kind} {len(rs):,}" + (f" ({missing:,} not in the index)" if missing else ""))
    return "; ".join(parts) + (" (--wide lists them)" if parts else "")


COMMANDS = (scan, stats, ls, show)
