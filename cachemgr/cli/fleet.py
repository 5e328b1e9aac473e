"""fleet report, remote stats|push|evict: the fleet tier. None of these imports torch."""

from __future__ import annotations

from dataclasses import replace

import click

from cachemgr.cli.common import (
    COUNT,
    DURATION,
    SIZE,
    Col,
    age,
    cells,
    emit_json,
    fit,
    human_size,
    json_option,
    pass_app,
    say,
    table,
    terminal_width,
)
from cachemgr.errors import UsageError


@click.group()
def fleet() -> None:
    """Every host of one shared index (--db postgresql+psycopg://...).

    \b
    Example:
        cachemgr --db postgresql+psycopg://cachemgr@db/cachemgr fleet report
    """


@fleet.command()
@click.option(
    "--min-hosts",
    type=COUNT,
    default=2,
    show_default=True,
    help="List graphs held by at least this many hosts.",
)
@click.option("--limit", type=COUNT, default=20, show_default=True, help="At most this many graphs.")
@click.option("--window", type=DURATION, default="1d", show_default=True, help="Window for the hit events.")
@json_option
@pass_app
def report(app, min_hosts: int, limit: int, window: float, as_json: bool) -> None:
    """Per host bytes, entries and hits; graphs on many hosts; torch versions and stale bytes.

    A host runs the torch version of its newest fxgraph entry; versions no host runs (and not in
    keep_torch) hold `stale` bytes: their fxgraph entries and what only those entries need.

    \b
    Example:
        cachemgr --db postgresql+psycopg://root@127.0.0.1/test fleet report
        cachemgr fleet report --json | jq .stale_bytes
    """
    from cachemgr.fleet.report import fleet_report

    keep = app.settings.keep_torch
    r = fleet_report(app.index_store, min_hosts=min_hosts, limit=limit, window=window, keep_torch=keep)
    if as_json:
        emit_json(r.as_dict())
        return
    if not r.hosts:
        click.echo("no hosts in this index yet (run: cachemgr scan on each host)")
        return
    table(
        (
            Col("host", cut=True),
            Col("caches", right=True),
            Col("entries", right=True),
            Col("bytes", right=True),
            Col("hits", right=True),
            Col(f"hits {window / 3600:g}h", right=True),
            Col("torch", cut=True, min=8),
            Col("last scan", right=True),
        ),
        [
            (
                h["host"],
                h["caches"],
                h["entries"],
                human_size(h["bytes"]),
                h["hit_count"],
                h["hits_in_window"],
                h["torch_version"] or "-",
                age(h["last_scan_ts"]),
            )
            for h in r.hosts
        ],
        title="hosts",
    )
    if r.shared_graphs:
        table(
            (
                Col("graph", cut=True, min=12),
                Col("hosts", right=True),
                Col("entries", right=True),
                Col("bytes", right=True),
                Col("redundant", right=True),
                Col("compile", right=True),
            ),
            [
                (
                    g["graph_key"],
                    g["hosts"],
                    g["entries"],
                    human_size(g["bytes"]),
                    human_size(g["redundant_bytes"]),
                    "" if g["compile_seconds"] is None else f"{g['compile_seconds']:.2f}s",
                )
                for g in r.shared_graphs
            ],
            title=f"graphs on {min_hosts}+ hosts",
        )
    else:
        click.echo(f"no graph is held by {min_hosts} or more hosts")
    table(
        (
            Col("torch", cut=True, min=8),
            Col("in use"),
            Col("hosts", right=True),
            Col("fxgraph entries", right=True),
            Col("bytes", right=True),
        ),
        [
            (
                v["torch_version"],
                "yes" if v["in_use"] else "no",
                v["hosts"],
                v["fxgraph_entries"],
                human_size(v["bytes"]),
            )
            for v in r.versions
        ],
        title="torch versions",
    )
    click.echo(f"held by versions no host runs: {human_size(r.stale_bytes)}")


# -- remote -----------------------------------------------------------------------------------


@click.group()
@click.option(
    "--redis",
    "redis_url",
    metavar="URL",
    help="Redis of the remote cache. Default, first found: $CACHEMGR_REDIS_URL, redis_url in the "
    "config, $TORCHINDUCTOR_REDIS_URL, $TORCHINDUCTOR_REDIS_HOST/_PORT as Inductor reads them "
    "(a config's redis_url wins over the Redis Inductor is told of); none of these is a usage "
    "error (exit 2).",
)
@click.pass_context
def remote(ctx: click.Context, redis_url: str | None) -> None:
    """PyTorch's Redis remote cache, the fleet's shared artifact tier.

    Inductor reads it when TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE=1 (and, for AOTAutograd entries,
    TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1) with TORCHINDUCTOR_REDIS_URL set.

    \b
    Example:
        cachemgr remote --redis redis://cache:6379/0 stats
        cachemgr remote push --graph fgv4ud3t...
        cachemgr remote evict --max-size 50GiB --max-age 30d --dry-run
    """
    ctx.meta["redis_url"] = redis_url


def _remote(app):
    from cachemgr.fleet.remote import Remote, configured_url

    settings = app.settings  # (read whatever --redis says: a config file that is wrong is exit 2 here too)
    url = click.get_current_context().meta.get("redis_url") or settings.redis_url
    return Remote(configured_url(url, what="remote", flag="--redis URL"))


def _say_skipped(skipped) -> None:
    """What was under a torch key but could not be used, and why: one line each (stderr)."""
    width = terminal_width()
    for x in skipped[:50]:  # (a key of 1,024 characters, a reason quoting Redis: cut, where a terminal is)
        line = f"cachemgr: remote: skipped {fit(x.key, width and max(20, width // 2))}: "
        say(line + fit(x.reason, width and max(20, width - cells(line))), err=True)
    if len(skipped) > 50:
        say(f"cachemgr: remote: skipped {len(skipped) - 50} more keys", err=True)


@remote.command(name="stats")
@json_option
@pass_app
def remote_stats(app, as_json: bool) -> None:
    """Entries and bytes in Redis by cache kind (bytes: Redis's MEMORY USAGE of each key).

    \b
    Example:
        cachemgr remote stats --json | jq .by_kind.fxgraph
    """
    from cachemgr.fleet.remote import iter_kinds

    rem = _remote(app)
    try:
        s = rem.stats()
    finally:
        rem.close()
    if as_json:
        emit_json(s.as_dict())
        return
    rows = [(k, n, human_size(b)) for k, n, b in iter_kinds(s)]
    rows.append(("total", s.entries, human_size(s.bytes)))
    table(("kind", "entries", "bytes"), rows, title=s.url)
    idle = "-" if s.max_idle_seconds is None else f"{s.max_idle_seconds / 86400:.1f}d"
    say(
        f"pushed by cachemgr {s.pushed_by_cachemgr}, longest idle {idle}, other keys in this db {s.other_keys}"
        + (f", {len(s.skipped)} skipped" if s.skipped else "")
    )
    _say_skipped(s.skipped)


@remote.command()
@click.option("--model", metavar="NAME", help="Only the graphs of this recorded model (see: cachemgr shapes).")
@click.option("--graph", metavar="KEY", help="Only this fxgraph or aotautograd key (and the entries it goes with).")
@click.option("--force", is_flag=True, help="Overwrite keys already in Redis.")
@click.option("--no-scan", is_flag=True, help="Trust the index as it is (default: reconcile it with the disk first).")
@json_option
@pass_app
def push(app, model: str | None, graph: str | None, force: bool, no_scan: bool, as_json: bool) -> None:
    """Publish local fxgraph and AOTAutograd entries in the form Inductor reads.

    Without --model/--graph every entry goes. A key already in Redis is left alone. Redis
    holds one value per key, so of a graph compiled for several guard sets the newest goes.
    AOTAutograd keys hash torch._functorch.config, TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE
    included: AOT entries serve the hosts that compile with the same setting as this one did.
    FX graph keys do not depend on the remote settings.

    \b
    Example:
        cachemgr remote push
        cachemgr remote push \\
            --graph fgv4ud3tijkbzc4tbcqhirql64dqih532zwb4egaukwwkig3de4n
        cachemgr remote push --model ranker --json
    """
    from cachemgr.fleet.remote import push_items

    if model and graph:
        raise UsageError("give --model or --graph, not both")
    rem = _remote(app)
    try:
        rem.ping()  # a Redis that is down fails before the scan, not after
        if not no_scan:
            from cachemgr.cli.inspect import run_scan

            run_scan(app, quiet_progress=as_json)
        items, extra, refused = push_items(app.store, model=model, graph=graph)
        r = rem.push(items, app.settings.cache_dir, app.settings.host, force=force)
    finally:
        rem.close()
    r = replace(r, skipped_guard_sets=extra, skipped=refused + list(r.skipped))
    if as_json:
        emit_json(r.as_dict())
        return
    say(
        f"pushed {len(r.pushed)} entries ({human_size(r.bytes)}) to {rem.shown}; "
        f"{len(r.present)} already there"
        + (f"; {extra} extra guard sets not pushed" if extra else "")
        + (f"; {len(r.skipped)} skipped" if r.skipped else "")
    )
    width = terminal_width()
    for path in r.missing:  # (an index's key: escaped, and cut where a terminal is)
        say(f"gone from disk, not pushed: {fit(path, width and max(20, width - 28))}", err=True)
    _say_skipped(r.skipped)


@remote.command(name="evict")
@click.option("--max-size", type=SIZE, help="Hold the remote tier under this many bytes (MEMORY USAGE).")
@click.option("--max-age", type=DURATION, help="Delete keys no one has read for this long (OBJECT IDLETIME).")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan; change nothing in Redis (an AOT entry whose graphs are not known yet is not read).",
)
@json_option
@pass_app
def remote_evict(app, max_size: int | None, max_age: float | None, dry_run: bool, as_json: bool) -> None:
    """Delete remote-cache keys over an age cap, then the least recently read down to the size cap.

    The size cap evicts down to low_water x max-size; keys read within the grace period stay; an
    AOT entry goes with a graph it needs. A key read between plan and delete is kept.

    \b
    Example:
        cachemgr remote evict --max-size 50GiB --max-age 30d
        cachemgr remote evict --max-age 14d --dry-run --json
    """
    from cachemgr.fleet.remote import plan_eviction

    if max_size is None and max_age is None:
        raise UsageError("give --max-size and/or --max-age")
    s = app.settings
    rem = _remote(app)
    skipped: list = []
    try:
        keys = rem.inspect(skipped=skipped)
        refs = rem.aot_refs(keys, skipped, learn=not dry_run)  # (a dry run reads no value, writes no meta)
        plan = plan_eviction(keys, refs, max_size, max_age, low_water=s.low_water, grace=s.grace)
        result = None if dry_run else rem.execute(plan)
    finally:
        rem.close()
    if as_json:
        emit_json(
            {
                "plan": plan.as_dict(),
                "result": result.as_dict() if result else None,
                "skipped": [x.as_dict() for x in skipped],
            }
        )
        return
    _say_skipped(skipped)
    verb = "would free" if dry_run else "freed"
    freed = plan.expected_freed_bytes if result is None else result.freed_bytes
    n = len(plan.victims) if result is None else len(result.deleted)
    say(
        f"{rem.shown}: {human_size(plan.total_bytes)} in {len(keys)} keys; {verb} {human_size(freed)} "
        f"({n} keys)"
        + (f"; {plan.kept_young} kept by the grace period" if plan.kept_young else "")
        + (f"; {len(result.skipped_in_use)} read meanwhile, kept" if result and result.skipped_in_use else "")
    )
    if dry_run and plan.victims:
        table(
            ("reason", Col("bytes", right=True), Col("idle", right=True), Col("key", cut=True, min=20)),
            [(v.reason, human_size(v.bytes), f"{v.idle}s", v.rkey) for v in plan.victims],
        )


COMMANDS = (fleet, remote)
