"""evict, purge, pin, unpin: the commands that delete (through cachemgr.evict only) and protect."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager

import click

from cachemgr.cli.common import DURATION, SIZE, emit_json, human_size, json_option, pass_app, table
from cachemgr.errors import NotFound, UsageError
from cachemgr.layout import KINDS

SHOWN = 20  # plan lines printed for people; --json has them all
RECENT_HITS = 7 * 86400  # purge --stale: torch versions hit this recently are still in use

grace_option = click.option("--grace", type=DURATION,
                            help="Leave files written or read more recently than this (default from settings: 60s).")
dry_run_option = click.option("--dry-run", is_flag=True, help="Show what would go; delete nothing.")


@contextmanager
def _locked_and_scanned(app):
    """The cache root, refused unless it looks like an Inductor cache (before walking all of `/`
    to plan its deletion), locked against other evictions, and scanned: plans are made from the
    disk as it is, every file stat'ed (full), so access times that moved without a directory
    changing (hits on a host without the daemon) count too."""
    from cachemgr.cli.inspect import run_scan
    from cachemgr.evict.execute import exclusive

    def waiting() -> None:
        click.echo("cachemgr: another eviction of this cache is running; waiting for it to finish", err=True)

    with exclusive(app.settings.cache_dir, waiting) as root:
        run_scan(app, quiet_progress=True, full=True)
        yield root


HELD = {"grace": "in use within the grace period", "pinned": "pinned"}  # why a wanted entry was kept


def _print_plan(p, verb: str) -> None:
    entries = p.entries
    if not entries:
        return
    table(("key", "kind", "bytes", "why"),
          [(e.key, e.kind, human_size(e.bytes), e.reason) for e in entries[:SHOWN]])
    if len(entries) > SHOWN:
        click.echo(f"... and {len(entries) - SHOWN} more")
    click.echo(f"plan: {verb} {len(entries)} entries, {human_size(p.expected_freed_bytes)} expected"
               + (f" ({human_size(p.recreatable_bytes)} recreated on the next hit)" if p.recreatable_bytes else ""))


def _print_result(r, cache_dir: str) -> None:
    if r.dry_run:
        click.echo(f"dry run: would free {human_size(r.freed_bytes)} in {r.evicted} entries; nothing deleted")
    else:
        click.echo(f"evicted {r.evicted} entries, freed {human_size(r.freed_bytes)}; "
                   f"{human_size(r.remaining_bytes)} left in {cache_dir}")
    for key, reason in r.skipped[:SHOWN]:
        click.echo(f"kept {key}: {reason}", err=True)
    if len(r.skipped) > SHOWN:
        click.echo(f"kept {len(r.skipped) - SHOWN} more", err=True)


@click.command()
@click.option("--max-size", type=SIZE, help="Size cap, e.g. 20GiB; evicts down to low_water (90%) of it.")
@click.option("--max-age", type=DURATION, help="Evict what was not accessed for this long, e.g. 14d.")
@click.option("--max-files", type=click.IntRange(min=0), help="File-count cap (inode quotas).")
@click.option("--min-free", metavar="SIZE|PCT", help="Free-space floor on the cache's file system, e.g. 10% or 50GiB.")
@click.option("--policy", type=click.Choice(["lru", "cost"]),
              help="lru (the default): least recently used first; cost: keep what is expensive to "
                   "recompile per byte.")
@grace_option
@dry_run_option
@json_option
@pass_app
def evict(app, max_size, max_age, max_files, min_free, policy, grace, dry_run, as_json) -> None:
    """Evict entries until the cache is within its limits.

    Limits come from the flags, else the config file / CACHEMGR_* environment. Orphans go first,
    then modules and Triton kernels a kept graph recreates on its next hit, then whole graphs
    (with their kernels and builds) by policy. Pinned entries, files used within the grace period
    and entries under a held lock are never taken. With --dry-run, `evicted` and `freed_*` say what
    a real run would take now; nothing is deleted.

    \b
    Example:
        cachemgr evict --max-size 20GiB --dry-run
        cachemgr evict --max-age 14d --policy cost --json | jq .freed_bytes
    """
    from cachemgr.evict import Limits

    s = app.with_flags(max_size=max_size, max_age=max_age, max_files=max_files, min_free=min_free,
                       policy=policy, grace=grace)
    limits = Limits.from_settings(s)
    if not limits.any:
        raise UsageError("no limit to evict to: give --max-size, --max-age, --max-files or --min-free "
                         "(or set max_size / max_age in the config)")
    with _locked_and_scanned(app) as root:
        _evict(app, root, s, limits, dry_run, as_json)


def _evict(app, root, s, limits, dry_run: bool, as_json: bool) -> None:
    from cachemgr.evict import carry_out, make_plan

    now = time.time()
    p, rows = make_plan(app.db, app.cache_id, root, limits, s.policy, now)
    if not as_json:
        if not p.units and p.skipped:
            held = Counter(why for _, why in p.skipped)
            click.echo(f"nothing can be evicted now: {human_size(p.total_bytes)} in {p.total_files} files is over "
                       "the limits, but the entries it would take are kept ("
                       + ", ".join(f"{n} {HELD.get(why, why)}" for why, n in sorted(held.items())) + ")")
        elif not p.units:
            click.echo(f"nothing to evict: {human_size(p.total_bytes)} in {p.total_files} files is within the limits")
        _print_plan(p, "evict")
    r = carry_out(app.db, app.cache_id, root, p, rows, limits.grace, dry_run, now)
    if as_json:
        emit_json(r.as_dict())
    elif p.units:
        _print_result(r, s.cache_dir)


@click.command()
@click.option("--all", "all_", is_flag=True, help="Every entry (pins stay unless --include-pinned).")
@click.option("--older-than", type=DURATION, help="Entries not accessed for this long.")
@click.option("--kind", type=click.Choice(KINDS), help="Entries of this kind.")
@click.option("--key", metavar="KEY", help="One entry (key, graph key / ref, or unique key prefix).")
@click.option("--graph", metavar="KEY", help="Every entry of this graph key.")
@click.option("--torch-version", metavar="V", help="Entries compiled by this torch version.")
@click.option("--stale", is_flag=True, help="Entries of torch versions this host no longer runs "
              "(learned from recent hits, or given with --keep-torch).")
@click.option("--keep-torch", metavar="V[,V]", help="Torch versions --stale keeps.")
@click.option("--orphans", is_flag=True, help="Files no entry references.")
@click.option("--corrupt", is_flag=True, help="Entries that cannot be read.")
@click.option("--include-pinned", is_flag=True, help="Delete pinned entries too.")
@grace_option
@dry_run_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask before deleting.")
@json_option
@pass_app
def purge(app, all_, older_than, kind, key, graph, torch_version, stale, keep_torch, orphans, corrupt,
          include_pinned, grace, dry_run, yes, as_json) -> None:
    """Delete chosen entries (with what only they reference). Several choices: entries matching all.

    Says how much it would free and asks first, unless --yes or --dry-run.

    \b
    Example:
        cachemgr purge --older-than 30d --dry-run
        cachemgr purge --stale --keep-torch 2.11.0+cu130 --yes
        cachemgr purge --all --yes --json
    """
    if not any((all_, older_than is not None, kind, key, graph, torch_version, stale, orphans, corrupt)):
        raise UsageError("say what to purge: --all, --older-than, --kind, --key, --graph, --torch-version, "
                         "--stale, --orphans or --corrupt")
    if keep_torch and not stale:
        raise UsageError("--keep-torch only says what --stale keeps: give --stale too")
    s = app.with_flags(grace=grace, keep_torch=keep_torch)
    with _locked_and_scanned(app) as root:
        _purge(app, root, s, all_, older_than, kind, key, graph, torch_version, stale, orphans, corrupt,
               include_pinned, dry_run, yes, as_json)


def _purge(app, root, s, all_, older_than, kind, key, graph, torch_version, stale, orphans, corrupt,
           include_pinned, dry_run, yes, as_json) -> None:
    from cachemgr.evict import carry_out, load_rows, purge_plan
    from cachemgr.evict.policy import Graph

    now = time.time()
    rows = load_rows(app.db, app.cache_id, root)
    g = Graph.build(rows)
    tests = []
    if older_than is not None:
        tests.append(lambda i, r: r.touched < now - older_than)
    if kind:
        tests.append(lambda i, r: r.kind == kind)
    if key:
        named = _named(app, key)
        tests.append(lambda i, r: r.key in named)
    if graph:
        if not any(graph in (r.graph_key, r.ref) for r in rows):  # a name, like --key: say it is unknown
            raise NotFound(f"no entry of graph {graph!r} in the index of {app.settings.cache_dir} (try: cachemgr ls)")
        tests.append(lambda i, r: graph in (r.graph_key, r.ref))
    if torch_version:
        tests.append(lambda i, r: r.torch_version == torch_version)
    if stale:
        keep = _torch_in_use(app, rows, now, s.keep_torch)
        tests.append(lambda i, r: r.torch_version is not None and r.torch_version not in keep)
    if orphans:
        tests.append(lambda i, r: g.is_orphan(i))
    if corrupt:
        tests.append(lambda i, r: r.corrupt is not None)
    chosen = [i for i, r in enumerate(rows) if all(t(i, r) for t in tests)]
    p = purge_plan(rows, chosen, now, s.grace, include_pinned)
    if not p.units:
        if as_json:
            emit_json(carry_out(app.db, app.cache_id, root, p, rows, s.grace, True, now).as_dict())
        else:
            click.echo("nothing to purge" + (f" ({len(p.skipped)} matching entries kept: pinned or in use)"
                                             if p.skipped else ""))
        return
    if not as_json:
        _print_plan(p, "delete")
    if not dry_run and not yes:
        click.confirm(f"delete {len(p.entries)} entries ({human_size(p.expected_freed_bytes)})?", abort=True, err=True)
    r = carry_out(app.db, app.cache_id, root, p, rows, s.grace, dry_run, now)
    if as_json:
        emit_json(r.as_dict())
    else:
        _print_result(r, s.cache_dir)


def _named(app, key: str) -> set[str]:
    from cachemgr.index.queries import find_entries

    with app.db.engine.connect() as conn:
        found = find_entries(conn, app.cache_id, key)
    if not found:
        raise NotFound(f"no entry {key!r} in the index of {app.settings.cache_dir} (try: cachemgr ls)")
    return {r.key for r in found}


def _torch_in_use(app, rows, now: float, keep_torch: list[str]) -> set[str]:
    """Torch versions still running here: given, or seen in hits of the last week."""
    from sqlalchemy import select

    from cachemgr.index.models import Event

    t = Event.__table__
    with app.db.engine.connect() as conn:
        hit_graphs = set(conn.execute(select(t.c.graph_key).where(
            t.c.cache_id == app.cache_id, t.c.kind == "hit", t.c.ts >= now - RECENT_HITS)).scalars())
    keep = {v for v in keep_torch if v}
    keep |= {r.torch_version for r in rows if r.torch_version and (
        r.graph_key in hit_graphs or (r.hit_count and r.last_access >= now - RECENT_HITS))}
    if not keep:
        raise UsageError("cannot tell which torch versions this host still runs (no recent hits recorded): "
                         "give --keep-torch VERSION[,VERSION]")
    return keep


@click.command()
@click.argument("key")
@click.option("--reason", metavar="TEXT", help="Why it must stay (shown by ls --pinned --json).")
@click.option("--force", is_flag=True, help="Pin a key the index does not hold (yet).")
@pass_app
def pin(app, key: str, reason: str | None, force: bool) -> None:
    """Keep an entry (or every entry of a graph key / ref) from eviction and purge.

    \b
    Example:
        cachemgr pin fgv4ud3tijkbzc4tbcqhirql64dqih532zwb4egaukwwkig3de4n --reason "prod model"
        cachemgr ls --pinned
    """
    from cachemgr.index.queries import add_pin, find_entries

    with app.db.engine.begin() as conn:
        found = find_entries(conn, app.cache_id, key)
        exact = any(key in (r.key, r.graph_key, r.ref) for r in found)
        if not exact:
            if found:
                key = found[0].key  # a unique prefix (find_entries refuses others): pin the entry it names
            elif not force:
                raise NotFound(f"no entry {key!r} in the index of {app.settings.cache_dir} "
                               "(run: cachemgr scan; or pin it anyway with --force)")
        new = add_pin(conn, app.cache_id, key, reason, time.time())
    click.echo(("pinned " if new else "already pinned ") + key)


@click.command()
@click.argument("key")
@pass_app
def unpin(app, key: str) -> None:
    """Let eviction take a pinned key again.

    \b
    Example:
        cachemgr unpin fgv4ud3tijkbzc4tbcqhirql64dqih532zwb4egaukwwkig3de4n
    """
    from cachemgr.index.queries import remove_pin

    with app.db.engine.begin() as conn:
        if not remove_pin(conn, app.cache_id, key):
            raise NotFound(f"{key!r} is not pinned (see: cachemgr ls --pinned)")
    click.echo("unpinned " + key)


COMMANDS = (evict, purge, pin, unpin)
