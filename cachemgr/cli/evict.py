"""evict, purge, pin, unpin: the commands that delete (through cachemgr.evict only) and protect."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property

import click

from cachemgr import fingerprint, safefs
from cachemgr.cli.common import (
    DURATION,
    KEY,
    SIZE,
    Col,
    age,
    clean,
    emit_json,
    exit_codes,
    human_size,
    json_option,
    model_option,
    pass_app,
    plural,
    quiet_option,
    say,
    table,
    wide_option,
)
from cachemgr.errors import CacheDirError, CachemgrError, NotFound, UsageError
from cachemgr.layout import KINDS
from cachemgr.vocab import Fate, Held, Kind, Policy

SHOWN = 20  # plan lines printed for people; --json has them all
SHOWN_PINS = 6  # pinned entries named where a plan says why it kept what it wanted
RECENT_HITS = 7 * 86400  # purge --stale: torch versions hit this recently are still in use

grace_option = click.option(
    "--grace",
    type=DURATION,
    help="Leave files written or read more recently than this (default from settings: 60s).",
)
REFUSED = (
    1,
    "the file system refused deletes (said after the result);"
    "\nshort of memory or descriptors, or an eviction worker died",
)
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
        try:  # the scan went by the name: it must still name the directory locked (and checked)
            same = safefs.identity(os.stat(app.settings.cache_dir)) == root.id
        except OSError:
            same = False
        if not same:
            raise CacheDirError(f"{app.settings.cache_dir} was replaced during the scan: nothing deleted")
        yield root


def _pin_holders(g) -> dict[int, int]:
    """Each entry a pin keeps, and the pinned entry that keeps it: the pinned one itself, and
    what it needs (its descendants). Each pinned entry's closure is walked once."""
    from cachemgr.evict.policy import PINNED

    held: dict[int, int] = {}
    for q, f in enumerate(g.rows.flags):
        if f & PINNED:
            for d in g.descendants([q]):
                held.setdefault(d, q)
    return held


def _pin_holding(g, head: int, held: dict[int, int]) -> int:
    """The pinned entry whose pin keeps the deletion group of `head` whole: it, or an entry it
    needs, is in the group (a group goes whole or not at all)."""
    return next((held[m] for m in g.closure([head]) if m in held), head)


def _kept_text(app, p, rows, grace: float) -> str:
    """held_text of the entries a plan wanted but kept, naming the pinned entries that keep them
    (what `ls --pinned` lists: a group is kept whole for a pinned entry of it, or one it needs)."""
    text = held_text([why for _, why in p.skipped], grace)
    pinned = [k for k, why in p.skipped if why == Held.PINNED]
    if not pinned:
        return text
    g = rows.graph()
    held = _pin_holders(g)
    at = {k: i for i, k in enumerate(rows.key)}
    holders = list(dict.fromkeys(rows.key[_pin_holding(g, at[k], held)] for k in pinned))
    names = list(_shorts(app, rows, holders[:SHOWN_PINS], False).values())
    more = f" and {len(holders) - SHOWN_PINS} more" if len(holders) > SHOWN_PINS else ""
    return f"{text}, by the pin{'s' if len(holders) > 1 else ''} of {', '.join(names)}{more}"


def held_text(reasons: Sequence[str], grace: float) -> str:
    """'2 pinned, 1 in use within the grace period': why entries a plan wanted were kept."""
    words: dict[str, str] = {
        Held.PINNED: "pinned",
        Held.GRACE: "in use within the grace period",
        Held.UNPARSED: "not parsed yet",
        Held.MOUNTED: "at or by a mount point (another file system's)",
    }
    return ", ".join(f"{n:,} {words.get(why, why)}" for why, n in sorted(Counter(reasons).items()))


def _shorts(app, rows, keys: Sequence[str], wide: bool) -> dict[str, str]:
    """key -> the form to print (short, or whole with --wide) of these planned entries."""
    if wide:
        return {k: k for k in keys}
    wanted = set(keys)
    return app.store.short_keys(rows[i] for i, k in enumerate(rows.key) if k in wanted)


def _print_plan(app, p, rows, verb: str, wide: bool) -> None:
    if not p.units:
        return
    entries = list(itertools.islice(p.entries, SHOWN))
    shorts = _shorts(app, rows, [e.key for e in entries], wide)
    again = f" ({human_size(p.recreatable_bytes)} of it recreated on the next hit)" if p.recreatable_bytes else ""
    say(f"plan: {verb} {plural(p.planned, 'entry')}, {human_size(p.expected_freed_bytes)}{again}")
    table(
        [Col("key"), Col("kind"), Col("bytes", True), Col("why")],
        [(shorts.get(e.key, e.key), e.kind, human_size(e.bytes), e.reason) for e in entries],
        wide=wide,
    )
    if p.planned > SHOWN:
        click.echo(f"... and {p.planned - SHOWN:,} more (--json lists them all)")


def _print_result(r, cache_dir: str, grace: float, done: str) -> None:
    """What a run did (`done`: evicted, purged) or, dry, would do."""
    if r.dry_run:
        say(f"dry run: would free {human_size(r.freed_bytes)} in {plural(r.evicted, 'entry')}; nothing deleted")
    else:
        say(
            f"{done} {plural(r.evicted, 'entry')}, freed {human_size(r.freed_bytes)}; "
            f"{human_size(r.remaining_bytes)} left in {cache_dir}"
        )
    if r.skipped:
        say(
            f"kept {plural(len(r.skipped), 'entry')}: {held_text([why for _, why in r.skipped], grace)} "
            "(--json lists them)"
        )


def _print_keys(app, rows, keys: Sequence[str], wide: bool) -> None:
    shorts = _shorts(app, rows, keys, wide)
    for k in keys:
        click.echo(shorts.get(k, k))


def _model_rows(app, rows, model: str) -> set[str]:
    """Mark every entry pinned but the model's graphs (their AOT entries, and what only they need):
    only those may go. The keys that may go."""
    from cachemgr.evict.policy import PINNED

    graphs = app.store.model_graphs(model)
    g = rows.graph()
    heads = [
        i
        for i, kind in enumerate(rows.kind)
        if (kind == Kind.FXGRAPH and rows.graph_key[i] in graphs)
        or (kind == Kind.AOTAUTOGRAD and any(k == Kind.FXGRAPH and ref in graphs for k, ref in rows.refs.get(i, ())))
    ]
    mine = set(g.closure(heads))
    for i in range(len(rows)):
        if i not in mine:
            rows.flags[i] |= PINNED
    return {rows.key[i] for i in mine}


def _unreachable(p, limits, disk, freed_bytes: int, freed_files: int, dry_run: bool) -> str | None:
    """What a run leaves over a cap it cannot meet, or short of the free-space floor (everything
    else it would take is kept, or could not be deleted); `disk`: the file system as the plan
    found it; `freed_*`: what the run took (or, dry, would take)."""
    from cachemgr.evict.policy import needs

    left_bytes = p.total_bytes - freed_bytes
    left_files = p.total_files - freed_files
    remain = "would remain" if dry_run else "remain"
    if limits.max_size is not None and left_bytes > limits.max_size:
        return f"cannot get under max_size {human_size(limits.max_size)}: {human_size(left_bytes)} {remain}"
    if limits.max_files is not None and left_files > limits.max_files:
        return f"cannot get under max_files {limits.max_files:,}: {left_files:,} files {remain}"
    short_free = needs(limits, p.total_bytes, p.total_files, disk)[2]
    if short_free > freed_bytes:
        return (
            f"cannot reach min_free {limits.min_free} (needs {human_size(disk.free_bytes + short_free)} free): "
            f"{human_size(disk.free_bytes + freed_bytes)} {'would be' if dry_run else 'is'} free"
        )
    return None


def _refused(r) -> None:
    """Exit 1 where the file system refused to delete what the run planned (a read-only mount,
    permissions): the run's result is out (and --json's `skipped` names each), its limits unmet."""
    failed = sum(why == Held.FAILED for _, why in r.skipped)
    if failed and not r.dry_run:
        raise CachemgrError(
            f"the file system refused to delete {plural(failed, 'planned entry', 'planned entries')} "
            "(read-only, or not permitted): they stay"
        )


@click.command()
@click.option("--max-size", type=SIZE, help="Size cap, e.g. 20GiB; evicts down to low_water (90%) of it.")
@click.option("--max-age", type=DURATION, help="Evict what was not accessed for this long, e.g. 14d.")
@click.option("--max-files", type=click.IntRange(min=0), help="File-count cap (inode quotas).")
@click.option("--min-free", metavar="SIZE|PCT", help="Free-space floor on the cache's file system, e.g. 10% or 50GiB.")
@click.option(
    "--policy",
    type=click.Choice([p.value for p in Policy]),
    help="lru (the default): least recently used first; cost: keep what is expensive to recompile per byte.",
)
@model_option
@grace_option
@dry_run_option
@quiet_option
@wide_option
@json_option
@pass_app
@exit_codes(0, REFUSED, 2, 3, 4, 5, 7, 130)
def evict(app, max_size, max_age, max_files, min_free, policy, model, grace, dry_run, quiet, wide, as_json) -> None:
    """Evict entries until the cache is within its limits.

    Limits come from the flags, else the config file / CACHEMGR_* environment. Orphans go first,
    then modules and Triton kernels a kept graph recreates on its next hit, then whole graphs
    (with their kernels and builds) by policy. Pinned entries, files used within the grace period
    and entries under a held lock are never taken. With --model only that model's graphs may go.
    With --dry-run, `evicted` and `freed_*` say what a real run would take now; nothing is deleted.

    \b
    Example:
        cachemgr evict --max-size 20GiB --dry-run
        cachemgr evict --max-age 14d --model old-ranker
        cachemgr evict --max-age 14d --policy cost --json | jq .freed_bytes
    """
    from cachemgr.evict import Limits

    s = app.with_flags(
        max_size=max_size, max_age=max_age, max_files=max_files, min_free=min_free, policy=policy, grace=grace
    )
    limits = Limits.from_settings(s)
    if not limits.any:
        raise UsageError(
            "no limit to evict to: give --max-size, --max-age, --max-files or --min-free "
            "(or set max_size / max_age in the config)"
        )
    with _locked_and_scanned(app) as root:
        _evict(app, root, s, limits, model, dry_run, quiet, wide, as_json)


def plan_eviction(app, root, s, limits, now: float, model: str | None = None):
    """The plan `evict` makes now, and the rows it is made from: every entry of the cache under
    `limits`, by the settings' policy (with `model`, only that model's graphs may go)."""
    from cachemgr.evict import disk_state, load_clock, load_rows
    from cachemgr.evict.policy import plan

    rows = load_rows(app.db, app.cache_id, root, full=bool(model))  # (--model reads AOT entries' references)
    mine = _model_rows(app, rows, model) if model else None
    clock = load_clock(app.db, app.cache_id) if s.policy == "cost" else None  # GDSF's clock, as the last run left it
    p = plan(rows, limits, s.policy, now, disk_state(root), clock)
    if mine is not None:  # entries of other models are not "kept": they were never candidates
        p = replace(p, skipped=tuple((k, why) for k, why in p.skipped if k in mine))
    return p, rows


def _evict(app, root, s, limits, model, dry_run: bool, quiet: bool, wide: bool, as_json: bool) -> None:
    from cachemgr.evict import carry_out, disk_state

    now = time.time()
    p, rows = plan_eviction(app, root, s, limits, now, model)
    disk = disk_state(root)  # (measured before anything is deleted)
    loud = not (as_json or quiet)
    if loud:
        if not p.units and p.skipped:
            say(
                f"nothing can be evicted now: {human_size(p.total_bytes)} in {p.total_files:,} files is over "
                f"the limits, but the entries it would take are kept ({_kept_text(app, p, rows, limits.grace)})"
            )
        elif not p.units and _unreachable(p, limits, disk, 0, 0, True) is None:
            say(
                f"nothing to evict: {human_size(p.total_bytes)} in {p.total_files:,} files is within the limits"
                + (f" (only {model}'s entries were candidates)" if model else "")
            )
        _print_plan(app, p, rows, "evict", wide)
    r = carry_out(app.db, app.cache_id, root, p, rows, limits.grace, dry_run, now)
    unreachable = _unreachable(p, limits, disk, r.freed_bytes, r.freed_files, dry_run)
    if as_json:
        emit_json({**r.as_dict(), "unreachable": unreachable})
    elif quiet:
        _print_keys(app, rows, [k for k, *_ in r.entries], wide)
    else:
        if p.units:
            _print_result(r, s.cache_dir, limits.grace, "evicted")
        if unreachable is not None:
            say(unreachable + (f" ({_kept_text(app, p, rows, limits.grace)})" if p.skipped else ""))
    _refused(r)


# -- what eviction would do with one entry (show) --------------------------------------------------


@dataclass(frozen=True)
class EntryFate:
    """What `evict` would do now with one entry: `Fate`, and why (a plan reason, a `Held` reason,
    or why no limit takes it); `by`: the entry whose keep rule holds it, when not itself (the head
    of the group it would go with)."""

    fate: str
    reason: str
    by: str | None = None

    def as_dict(self) -> dict:
        return {"verdict": self.fate, "reason": self.reason, "by": self.by}


NO_LIMIT = "no limit is set (max_size, max_age, max_files, min_free)"


def entry_fates(app, keys: Sequence[str]) -> dict[str, EntryFate]:
    """What `evict --dry-run` would say of each entry now, under the configured limits: the plan
    it makes (plan_eviction), the units holding these entries looked at by the executor's keep
    rules (a dry run of those units alone: nothing is deleted, nothing written), and the plan's
    own kept reasons. Read-only: the cache is neither locked nor scanned (the index as it is)."""
    from cachemgr import safefs
    from cachemgr.evict import Limits, carry_out, disk_state
    from cachemgr.evict.policy import needs

    s = app.settings
    limits = Limits.from_settings(s)
    if not limits.any:
        return {k: EntryFate(Fate.NOT_PLANNED, NO_LIMIT) for k in keys}
    now = time.time()
    try:
        with safefs.Root(s.cache_dir) as root:
            p, rows = plan_eviction(app, root, s, limits, now)
            wanted = set(keys)
            units = tuple(u for u in p.units if any(e.key in wanted for e in u.entries))
            looked = carry_out(
                app.db, app.cache_id, root, replace(p, units=units, skipped=()), rows, limits.grace, True, now
            )
            over_bytes, over_files, short_free = needs(limits, p.total_bytes, p.total_files, disk_state(root))
    except OSError as e:
        why = EntryFate(Fate.UNKNOWN, f"cannot open {s.cache_dir}: {e.strerror}")
        return {k: why for k in keys}
    met = p.expected_freed_bytes >= max(over_bytes, short_free) and p.expected_freed_files >= over_files
    going = {k: why for k, _, _, why in looked.entries}
    held = dict(looked.skipped)
    head_of = {e.key: u.entries[0].key for u in units for e in u.entries}
    wanted_but_kept = dict(p.skipped)
    graph = None
    out = {}
    for k in keys:
        if k in going:
            out[k] = EntryFate(Fate.EVICTED, going[k])
        elif k in head_of and head_of[k] in held:  # its unit was looked at and kept whole
            head = head_of[k]
            out[k] = EntryFate(Fate.KEPT, held[head], None if head == k else head)
        elif k in head_of:  # the rest of its unit would go: its own files are gone already
            out[k] = EntryFate(Fate.NOT_PLANNED, "its files are gone already (a scan drops its row)")
        else:
            if graph is None:
                graph = _Reach(rows)
            out[k] = graph.fate(k, p, wanted_but_kept, met)
    return out


class _Reach:
    """Why the plan leaves an entry it did not take: a kept group it would go with, the limits
    met without it, or an entry that needs it kept."""

    def __init__(self, rows) -> None:
        self.keys, self.g = rows.key, rows.graph()
        self.index = {k: i for i, k in enumerate(rows.key)}

    def fate(self, key: str, p, kept: dict[str, str], met: bool) -> EntryFate:
        i = self.index.get(key)
        if i is None:
            return EntryFate(Fate.NOT_PLANNED, "not in the index now")
        keys = self.keys
        if key in kept:
            return self._kept(i, i, kept[key])
        needing = [a for a in self._needing(i) if keys[a] in kept]
        for a in needing:
            if i in self.g.closure([a]):  # it would go with that group, which is kept
                return self._kept(i, a, kept[keys[a]])
        if not p.units and not p.skipped:
            return EntryFate(Fate.NOT_PLANNED, "the cache is within its limits")
        if met:
            return EntryFate(Fate.NOT_PLANNED, "the limits are met without it")
        if needing:  # shared with a kept entry: it stays while that does
            return self._kept(i, needing[0], kept[keys[needing[0]]])
        if self.g.parents.count(i):
            return EntryFate(Fate.NOT_PLANNED, "an entry that needs it stays")
        return EntryFate(Fate.NOT_PLANNED, "taking it frees nothing the limits ask for")

    def _kept(self, i: int, head: int, why: str) -> EntryFate:
        """Entry i, kept with the group of `head` for `why`: `by` is that head, or for a pin the
        pinned entry that holds the group."""
        by = _pin_holding(self.g, head, self.pin_holders) if why == Held.PINNED else head
        return EntryFate(Fate.KEPT, why, None if by == i else self.keys[by])

    @cached_property
    def pin_holders(self) -> dict[int, int]:
        """_pin_holders, walked once however many entries `show` asks about (a graph's several)."""
        return _pin_holders(self.g)

    def _needing(self, i: int) -> list[int]:
        """Every entry that needs entry `i`, directly or through others: the nearest first."""
        seen: dict[int, None] = {}
        frontier = sorted(self.g.parents[i])
        while frontier:
            step = []
            for j in frontier:
                if j not in seen:
                    seen[j] = None
                    step.extend(sorted(self.g.parents[j]))
            frontier = step
        return list(seen)


@click.command()
@click.option("--all", "all_", is_flag=True, help="Every entry (pins stay unless --include-pinned).")
@click.option("--older-than", type=DURATION, help="Entries not accessed for this long.")
@click.option(
    "--kind",
    type=click.Choice(KINDS),
    metavar="KIND",
    multiple=True,
    help=f"Entries of this kind (repeatable): {', '.join(KINDS)}.",
)
@click.option(
    "--key",
    type=KEY,
    metavar="KEY",
    multiple=True,
    help="One entry, or every entry of a graph (any key form; repeatable).",
)
@click.option(
    "--graph",
    type=KEY,
    metavar="KEY",
    multiple=True,
    help="Every entry of this graph (any key form of it; repeatable).",
)
@click.option(
    "--model", metavar="NAME", multiple=True, help="The graphs of this model (recorded by cachemgr.record; repeatable)."
)
@click.option(
    "--torch-version", metavar="V", multiple=True, help="Entries compiled by this torch version (repeatable)."
)
@click.option(
    "--stale",
    is_flag=True,
    help="Entries of torch versions this host no longer runs (learned from recent hits, or given with --keep-torch).",
)
@click.option("--keep-torch", metavar="V[,V]", help="Torch versions --stale keeps.")
@click.option("--orphans", is_flag=True, help="Files no entry references.")
@click.option("--corrupt", is_flag=True, help="Entries that cannot be read.")
@click.option("--include-pinned", is_flag=True, help="Delete pinned entries too.")
@grace_option
@dry_run_option
@click.option("--yes", "-y", is_flag=True, help="Do not ask before deleting.")
@quiet_option
@wide_option
@json_option
@pass_app
@exit_codes(0, REFUSED, 2, 3, 4, 5, 7, (130, "interrupted (Ctrl-C), or declined at the prompt"))
def purge(
    app,
    all_,
    older_than,
    kind,
    key,
    graph,
    model,
    torch_version,
    stale,
    keep_torch,
    orphans,
    corrupt,
    include_pinned,
    grace,
    dry_run,
    yes,
    quiet,
    wide,
    as_json,
) -> None:
    """Delete chosen entries (with what only they reference). Several choices: entries matching all;
    a choice given more than once (--kind, --key, --graph, --model, --torch-version): any of them.

    Says how much it would free and asks first, unless --yes or --dry-run.

    \b
    Example:
        cachemgr purge --older-than 30d --dry-run
        cachemgr purge --model old-ranker --yes
        cachemgr purge --stale --keep-torch 2.11.0+cu130 --yes
        cachemgr purge --all --yes --json
    """
    if keep_torch and not stale:
        raise UsageError("--keep-torch only says what --stale keeps: give --stale too")
    if not any((all_, older_than is not None, kind, key, graph, model, torch_version, stale, orphans, corrupt)):
        raise UsageError(
            "say what to purge: --all, --older-than, --kind, --key, --graph, --model, "
            "--torch-version, --stale, --orphans or --corrupt"
        )
    if quiet and not (yes or dry_run):
        raise UsageError("--quiet cannot ask before deleting: give --yes or --dry-run too")
    if not (yes or dry_run) and not (sys.stdin and sys.stdin.isatty()):  # (None: stdin closed)
        raise UsageError("stdin is not a terminal: pass --yes (or --dry-run)")
    s = app.with_flags(grace=grace, keep_torch=keep_torch)
    with _locked_and_scanned(app) as root:
        tests = _purge_tests(app, older_than, kind, key, graph, model, torch_version, stale, corrupt, s.keep_torch)
        _purge(app, root, s, tests, orphans, include_pinned, dry_run, yes, quiet, wide, as_json)


def _purge_tests(app, older_than, kind, key, graph, model, torch_version, stale, corrupt, keep_torch) -> list:
    """What each choice asks of a row (index i of the rows, row r, the reference graph g)."""
    now = time.time()
    tests = []
    if older_than is not None:
        tests.append(lambda i, r, g: r.touched < now - older_than)
    if kind:
        tests.append(lambda i, r, g: r.kind in kind)
    if key:
        named = {e.key for k in key for e in app.store.resolve(k).entries}
        tests.append(lambda i, r, g: r.key in named)
    if graph:
        gks = {_graph_named(app, k) for k in graph}
        tests.append(lambda i, r, g: r.graph_key in gks or r.ref in gks)
    if model:
        graphs = {gk for m in model for gk in app.store.model_graphs(m, "--graph KEY")}
        tests.append(
            lambda i, r, g: (
                (r.kind == Kind.FXGRAPH and r.graph_key in graphs)
                or (r.kind == Kind.AOTAUTOGRAD and any(k == Kind.FXGRAPH and ref in graphs for k, ref in r.refs))
            )
        )
    if torch_version:
        known = app.store.fingerprint_names()
        tests.append(
            lambda i, r, g: any(
                fingerprint.version_matches(r.torch_version or known.get(r.torch_version_hash or ""), v)
                for v in torch_version
            )
        )
    if stale:
        keep: fingerprint.Keep | None = None

        def stale_row(i, r, g) -> bool:
            nonlocal keep
            if keep is None:
                keep = _torch_in_use(app, g.rows, now, keep_torch)
            return bool(keep.is_stale(r.torch_version, r.torch_version_hash))

        tests.append(stale_row)
    if corrupt:
        tests.append(lambda i, r, g: r.corrupt is not None)
    return tests


def _graph_named(app, spec: str) -> str:
    try:
        return app.store.resolve(spec).graph
    except NotFound:
        raise NotFound(
            f"no entry of graph {spec!r} in the index of {app.settings.cache_dir} (see: cachemgr ls --kind fxgraph)"
        ) from None


def _purge(app, root, s, tests, orphans, include_pinned, dry_run, yes, quiet, wide, as_json) -> None:
    from cachemgr.evict import carry_out, load_rows, purge_plan

    now = time.time()
    rows = load_rows(app.db, app.cache_id, root, full=True)
    g = rows.graph()
    if orphans:
        tests = [*tests, lambda i, r, g: g.is_orphan(i)]
    chosen = [i for i, r in enumerate(rows) if all(t(i, r, g) for t in tests)]
    p = purge_plan(rows, chosen, now, s.grace, include_pinned)
    if not p.units:
        if as_json:
            # (an empty plan carried out dry: a real run would still empty the trash and stamp
            # last_eviction, which the text path does not do either)
            empty = carry_out(app.db, app.cache_id, root, p, rows, s.grace, True, now)
            emit_json({**empty.as_dict(), "dry_run": dry_run})
        elif not quiet:
            say(
                "nothing to purge"
                + (
                    f" ({plural(len(p.skipped), 'matching entry', 'matching entries')} "
                    f"kept: {_kept_text(app, p, rows, s.grace)})"
                    if p.skipped
                    else ""
                )
            )
        return
    if not (as_json or quiet):
        _print_plan(app, p, rows, "delete", wide)
    if not dry_run and not yes:
        click.confirm(
            f"delete {plural(p.planned, 'entry')} ({human_size(p.expected_freed_bytes)})?", abort=True, err=True
        )
    r = carry_out(app.db, app.cache_id, root, p, rows, s.grace, dry_run, now)
    if as_json:
        emit_json(r.as_dict())
    elif quiet:
        _print_keys(app, rows, [k for k, *_ in r.entries], wide)
    else:
        _print_result(r, s.cache_dir, s.grace, "purged")
    _refused(r)


def _torch_in_use(app, rows, now: float, keep_torch: list[str]) -> fingerprint.Keep:
    """The torch builds to keep: given, else the one installed here (fingerprinted from its files)
    and those whose graphs were hit in the last week."""
    hit_graphs = app.store.hit_graphs(now - RECENT_HITS)
    recent = {
        r.torch_version
        for r in rows
        if r.torch_version and (r.graph_key in hit_graphs or (r.hit_count and r.last_access >= now - RECENT_HITS))
    }
    keep = fingerprint.keep_for(rows, keep_torch, recent, app.store.fingerprint_names(), fingerprint.installed_torch())
    if not keep.versions:
        raise UsageError(
            "cannot tell which torch versions this host still runs (torch is not installed here and "
            "no recent hits are recorded): give --keep-torch VERSION[,VERSION]"
        )
    return keep


# -- pins ---------------------------------------------------------------------------------------------


@click.command()
@click.argument("key", type=KEY, required=False)
@click.option("--reason", metavar="TEXT", help="Why it must stay (shown by cachemgr pin and ls --pinned --json).")
@click.option("--force", is_flag=True, help="Pin a key the index does not hold (yet).")
@click.option("-q", "--quiet", is_flag=True, help="With KEY: print nothing. Without: the pinned keys only, one a line.")
@wide_option
@json_option
@pass_app
@exit_codes(0, 2, 3, 4, 5)
def pin(app, key: str | None, reason: str | None, force: bool, quiet: bool, wide: bool, as_json: bool) -> None:
    """Keep an entry, or every entry of a graph, from eviction and purge. Without KEY: list the pins.

    KEY is any key a command prints (one that begins with '-' goes after `--`). A graph key, or a
    short key of a whole graph, pins the graph: every guard set compiled for it, now and later.

    \b
    Example:
        cachemgr pin fgv4ud3t --reason "prod model"
        cachemgr pin                       # every pin, with the entries it keeps
        cachemgr ls --model ranker -q | xargs -n1 cachemgr pin
    """
    if key is None and (reason is not None or force):
        raise UsageError(
            f"{'--reason' if reason is not None else '--force'} needs a KEY (pin without one lists the pins)"
        )
    store = app.store
    if key is None:
        _list_pins(store, quiet, wide, as_json)
        return
    if os.path.isdir(app.settings.cache_dir):  # as every command: a cache never scanned is scanned
        from cachemgr.cli.inspect import scanned_store

        scanned_store(app)
    try:
        match = store.resolve(key)
        target = match.ref if match.ref is not None else match.entries[0].key
    except NotFound:
        if not force:
            raise NotFound(
                f"no entry {key!r} in the index of {app.settings.cache_dir} (pin it anyway with --force)"
            ) from None
        target = key
    before = store.add_pin(target, reason)
    shown = target if wide else _pin_short(store, target)
    if as_json:
        emit_json(
            {
                "key": target,
                "short": _pin_short(store, target),
                "new": before is None,
                "reason": reason if reason is not None else (before.reason if before else None),
                "previous_reason": before.reason if before else None,
            }
        )
    elif quiet:
        pass
    elif before is None:
        click.echo(
            f"pinned {shown}"
            + (f" ({clean(reason)})" if reason else "")
            + ("" if target == key or target.startswith(key) else f" (named {clean(key)})")
        )
    elif reason is not None and reason != before.reason:
        click.echo(
            f"{shown} is already pinned; its reason is now {clean(reason)!r}"
            + (f" (was {clean(before.reason)!r})" if before.reason else "")
        )
    else:
        click.echo(f"{shown} is already pinned" + (f" ({clean(before.reason)})" if before.reason else ""))


def _pin_short(store, key: str) -> str:
    """The short form of a pinned key: of its entry, or of the ref (graph) it names."""
    e = store.entry_by_key(key)
    if e is not None:
        return store.short_keys([e])[key]
    return store.short_graph_keys([key])[key]


def _list_pins(store, quiet: bool, wide: bool, as_json: bool) -> None:
    pins = store.pins()
    if as_json:
        emit_json([{**p.as_dict(), "short": _pin_short(store, p.key)} for p in pins])
        return
    shown = [(p, p.key if wide else _pin_short(store, p.key)) for p in pins]
    if quiet:
        for _, k in shown:
            click.echo(k)
        return
    if not pins:
        click.echo("nothing is pinned (pin a key: cachemgr pin KEY --reason TEXT)")
        return
    table(
        [Col("key"), Col("entries", True), Col("pinned", True), Col("reason", cut=True)],
        [(k, f"{p.entries:,}" if p.entries else "none now", f"{age(p.created)} ago", p.reason or "") for p, k in shown],
        wide=wide,
    )
    click.echo(plural(len(pins), "pin"))


def _pin_named(store, spec: str) -> str:
    """The pinned key SPEC names: a pinned key, any key form of what a pin covers, or a unique
    prefix of a pinned key (pins of keys the index does not hold)."""
    pins = store.pin_map()
    if spec in pins:
        return spec
    named: set[str] = set()
    try:
        match = store.resolve(spec)
        named = {e.pin for e in match.entries if e.pin} | ({match.ref} & pins.keys())
    except NotFound:
        pass
    if not named and len(spec) >= 4:
        named = {k for k in pins if k.startswith(spec)}
    if not named:
        raise NotFound(f"{spec!r} is not pinned (see: cachemgr pin)")
    if len(named) > 1:
        raise UsageError(f"{spec!r} names {len(named)} pins ({', '.join(sorted(named))}): give one of them")
    return named.pop()


@click.command()
@click.argument("key", type=KEY)
@pass_app
@exit_codes(0, 2, 3, 5)
def unpin(app, key: str) -> None:
    """Let eviction take a pinned key again. KEY: any form of it a command prints (after `--`
    where it begins with '-').

    \b
    Example:
        cachemgr unpin fgv4ud3t
    """
    target = _pin_named(app.store, key)
    shown = _pin_short(app.store, target)
    app.store.remove_pin(target)
    click.echo(f"unpinned {shown}")


COMMANDS = (evict, purge, pin, unpin)
