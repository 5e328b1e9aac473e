"""Eviction: hold a cache under its limits (policy.py decides, execute.py deletes).

from cachemgr.evict import Limits, evict
result = evict(db, cache_id, root, Limits.from_settings(settings), policy="lru")
result.as_dict()   # the `cachemgr evict --json` document
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachemgr import layout, safefs
from cachemgr.evict.policy import (
    LAUNCHER,
    PARSED,
    PINNED,
    POLICIES,
    UNKNOWN,
    Clock,
    DiskState,
    KeyRefs,
    Limits,
    Plan,
    Row,
    Table,
    plan,
    select,
    table_of,
)
from cachemgr.index.store import MAX_BYTES, MAX_FILES, MAX_HITS, MAX_SECONDS, bounded, moment, whole
from cachemgr.vocab import PARSED as PARSE_DONE
from cachemgr.vocab import Kind

if TYPE_CHECKING:  # (the index's SQLAlchemy is not imported by eviction's worker processes)
    from cachemgr.index.db import Database

__all__ = ["POLICIES", "EvictResult", "Limits", "Plan", "Row", "Table", "evict", "load_rows", "make_plan", "carry_out"]


@dataclass(frozen=True)
class EvictResult:
    policy: str
    dry_run: bool
    planned: int
    expected_freed_bytes: int
    evicted: int
    freed_bytes: int
    freed_files: int
    remaining_bytes: int
    recreatable_freed_bytes: int
    entries: Sequence[tuple[str, str, int, str]]  # (key, kind, bytes, reason) evicted (or, dry run, would be)
    skipped: tuple[tuple[str, str], ...]  # (key, reason)
    in_place: bool = False  # some units were deleted in place: no room for the trash (a full disk)

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "dry_run": self.dry_run,
            "planned": self.planned,
            "expected_freed_bytes": self.expected_freed_bytes,
            "evicted": self.evicted,
            "freed_bytes": self.freed_bytes,
            "freed_files": self.freed_files,
            "remaining_bytes": self.remaining_bytes,
            "recreatable_freed_bytes": self.recreatable_freed_bytes,
            "entries": [{"key": k, "kind": kind, "bytes": b, "reason": why} for k, kind, b, why in self.entries],
            "skipped": [{"key": k, "reason": r} for k, r in self.skipped],
            "in_place": self.in_place,
        }


def load_rows(db: Database, cache_id: int, root: safefs.Root | str, full: bool = False) -> Table:
    """Every entry of the cache with its links and pin state, as the policy wants it (`full`: with
    its references and torch versions too, for Row views that show them: purge's selectors)."""
    if isinstance(root, str):
        with safefs.Root(root) as opened:
            return load_rows(db, cache_id, opened, full)
    from cachemgr.index.store import Store

    store = Store.of_id(db, cache_id)
    try:
        t = _table(store.policy_rows(), store.pin_map(), full)
        if full:
            for autotune in (True, False):
                for i, refs in itertools.groupby(_positioned(t, store.policy_refs(autotune)), key=lambda r: r[0]):
                    t.refs[i] = tuple((kind, ref) for _, kind, ref in refs)
            g = t.graph()
        else:  # linked as the references stream by: a table that is not full never holds them
            g = t.graph(_positioned(t, store.policy_refs(True)), _positioned(t, store.policy_refs(False)))
    finally:
        store.close()
    for i, kind in enumerate(t.kind):  # a kernel directory nothing names may be a launcher (cuda_utils .so)
        if kind == Kind.TRITON and not g.named[i] and _holds_binary(root, t.key[i]):
            t.flags[i] |= LAUNCHER
    return t


def _positioned(t: Table, refs: Iterable[tuple[int, str, str]]) -> Iterator[tuple[int, str, str]]:
    """(position, kind, ref) of the references of the table's entries (its rows came by id). An
    entry indexed since the rows were read (the daemon writes meanwhile) is not in the plan: its
    references are passed over."""
    ids = t.id
    for eid, kind, ref in refs:
        i = bisect.bisect_left(ids, eid)
        if i < len(ids) and ids[i] == eid:
            yield i, kind, ref


def _table(batches: Iterable[list[tuple]], pins: dict, full: bool) -> Table:
    """A Table of Store.policy_rows' batches, taken a column at a time (arrays extended in C: a
    row at a time was most of a plan's time at 1,000,000 files). The values most rows share (kind,
    the version and system hashes) are made one string each: the driver makes one per row."""
    t = Table(full)
    odd: dict[int, str | None] = {}  # refs their keys do not spell (none, as layout stands)
    t.ref = KeyRefs(t, odd)
    shared: dict[str, str] = {}
    one = shared.setdefault
    ref_of = layout.ref_of
    for rows in batches:
        at = len(t.id)
        columns = [_texts(c) for c in zip(*rows, strict=True)]  # in Store.POLICY_COLUMNS order
        ids, keys, kinds, refs, aliases, nbytes, files, mtimes, accessed, seconds = columns[:10]
        graph_keys, tvs, shs, corrupt, hits, tvhs, states = columns[10:]
        kinds = tuple(one(k, k) for k in kinds)
        spelled = zip(keys, kinds, refs, strict=True)
        odd.update((at + j, ref) for j, (key, kind, ref) in enumerate(spelled) if ref != ref_of(key, kind))
        t.id.extend(ids)
        t.key.extend(keys)
        t.kind.extend(kinds)
        t.alias.extend(aliases)
        t.graph_key.extend(graph_keys)
        t.corrupt.extend(corrupt)
        _numbers(t.bytes, nbytes, top=MAX_BYTES)
        _numbers(t.files, files, top=MAX_FILES)
        _numbers(t.mtime, mtimes, math.inf)  # an unknown time: as if just used, the last to go
        _numbers(t.last_access, accessed, math.inf)
        _numbers(t.compile_seconds, [UNKNOWN if cs is None else cs for cs in seconds], UNKNOWN, MAX_SECONDS)
        _numbers(t.hit_count, [h or 0 for h in hits], top=MAX_HITS)
        if pins:
            t.flags.extend(
                PINNED * any(k in pins for k in names if k) | PARSED * (state == PARSE_DONE)
                for names, state in zip(zip(keys, graph_keys, refs, strict=True), states, strict=True)
            )
        else:
            t.flags.extend(PARSED * (state == PARSE_DONE) for state in states)
        if t.versions is not None:
            t.versions.extend(
                (tv and one(tv, tv), sh and one(sh, sh), tvh and one(tvh, tvh))
                for tv, sh, tvh in zip(tvs, shs, tvhs, strict=True)
            )
    return t


def _texts(values: Sequence) -> Sequence:
    """A column's values, any BLOB among them (a hand-edited SQLite index) read as text, as
    `store.text` reads it: a key or ref of bytes is that entry's oddity, not a failed eviction."""
    if bytes not in map(type, values):
        return values
    from cachemgr.index.store import text

    return tuple(text(v) for v in values)


def _numbers(column: array, values: Sequence, missing: float = 0.0, top: float | None = None) -> None:
    """`column.extend(values)`, in C. Where a value is not a number of the column's kind (text in
    a hand-edited SQLite index), a time is not finite (NaN or Infinity in a PostgreSQL one), or,
    with `top`, a value is outside [0, top) (a negative size, a compile of 1e308 s: the cost
    policy's sums and its clock would be NaN or infinite), the batch goes again with each such
    value read as `store.whole` / `store.moment` read it, or as unknown: 0, or `missing` for
    times. compile_seconds (`missing` NaN) keeps NaN: its own "unknown"."""
    n = len(column)
    try:
        column.extend(values)
        if _all_fit(column[n:], missing, top):
            return
    except (TypeError, OverflowError):
        pass
    del column[n:]
    if column.typecode == "q":
        column.extend([bounded(whole(v), top) for v in values] if top is not None else map(whole, values))
    else:
        column.extend([v if top is None or 0.0 <= v < top else missing for v in (moment(v, missing) for v in values)])


def _all_fit(new: array, missing: float, top: float | None) -> bool:
    if not new:
        return True
    if new.typecode == "q":
        return top is None or (min(new) >= 0 and max(new) < top)
    if top is None:
        return math.isnan(missing) or math.isfinite(sum(new))
    return all(0.0 <= v < top for v in new if v == v)  # (NaN: unknown, as `missing` says)


def _holds_binary(root: safefs.Root, key: str) -> bool:
    try:
        return any(n.endswith(".so") for n in root.listdir(layout.fs_path(key)))
    except OSError:
        return False


def disk_state(root: safefs.Root) -> DiskState | None:
    try:
        st = os.fstatvfs(root.fd)
    except OSError:
        return None
    return DiskState(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def make_plan(
    db: Database, cache_id: int, root: safefs.Root | str, limits: Limits, policy: str = "lru", now: float | None = None
) -> tuple[Plan, Table]:
    if isinstance(root, str):
        with safefs.Root(root) as opened:
            return make_plan(db, cache_id, opened, limits, policy, now)
    rows = load_rows(db, cache_id, root)
    return plan(
        rows, limits, policy, time.time() if now is None else now, disk_state(root), load_clock(db, cache_id)
    ), rows


def load_clock(db: Database, cache_id: int) -> Clock:
    """The cost policy's clock as the last eviction left it."""
    from sqlalchemy import Text
    from sqlalchemy import cast as sql_cast
    from sqlalchemy import select as sql_select

    from cachemgr.index.models import Cache

    with db.engine.connect() as conn:  # (as text: a value that is not JSON must not stop eviction)
        row = conn.execute(
            sql_select(Cache.gds_clock, sql_cast(Cache.gds_history, Text)).where(Cache.id == cache_id)
        ).first()
    if row is None:
        return Clock()
    try:
        value = float(row[0] or 0.0)
        history = json.loads(row[1] or "[]")
    except (TypeError, ValueError, RecursionError):  # edited or damaged: the clock starts again, eviction goes on
        return Clock()
    if not math.isfinite(value) or not isinstance(history, list):
        return Clock()
    pairs = [p for p in history if isinstance(p, list) and len(p) == 2 and all(_finite(x) for x in p)]
    return Clock(value, [(float(t), float(v)) for t, v in pairs])


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def keep_clock(db: Database, cache_id: int, clock: Clock) -> None:
    """Keep the cost policy's clock for the next run. Called once the run's deletions are
    committed: a failure to write it (a full disk) is not the run's, and the next run's clock
    starts again, as load_clock starts one it cannot read."""
    from sqlalchemy import update
    from sqlalchemy.exc import SQLAlchemyError

    from cachemgr.index.models import Cache

    history = [list(p) for p in clock.history if all(map(math.isfinite, p))]
    try:
        with db.engine.begin() as conn:
            conn.execute(
                update(Cache)
                .where(Cache.id == cache_id)
                .values(gds_clock=clock.value if math.isfinite(clock.value) else 0.0, gds_history=history)
            )
    except SQLAlchemyError:
        pass


def carry_out(
    db: Database,
    cache_id: int,
    root: safefs.Root | str,
    p: Plan,
    rows: Sequence[Row],
    grace: float,
    dry_run: bool = False,
    now: float | None = None,
    hook: Callable[[str], None] | None = None,
) -> EvictResult:
    """Carry out plan `p` (made from `rows`) under a root opened by `exclusive` (a path: opened
    and locked here)."""
    from cachemgr.evict.execute import Executor, exclusive, remaining_bytes

    if isinstance(root, str):
        with exclusive(root) as opened:
            return carry_out(db, cache_id, opened, p, rows, grace, dry_run, now, hook)
    from cachemgr.evict.look import WorkerDied

    ex = Executor(db, cache_id, root, grace, now, hook)
    try:
        out = ex.run(p, table_of(rows), dry_run=dry_run)
    except (KeyboardInterrupt, WorkerDied):
        if ex.completed and not dry_run:  # Ctrl-C in the last batch, a worker found dead at the end: all went
            _keep(db, cache_id, p.clock)
        raise
    if not dry_run:
        _keep(db, cache_id, p.clock if out.removed else None)
    skipped = dict(p.skipped)
    skipped.update(out.skipped)
    remaining = remaining_bytes(db, cache_id)
    if dry_run:
        remaining -= out.freed_bytes
    return EvictResult(
        policy=p.policy,
        dry_run=dry_run,
        planned=p.planned,
        expected_freed_bytes=p.expected_freed_bytes,
        evicted=len(out.removed),
        freed_bytes=out.freed_bytes,
        freed_files=out.freed_files,
        remaining_bytes=remaining,
        recreatable_freed_bytes=out.recreatable_bytes,
        entries=out.removed,
        skipped=tuple(sorted(skipped.items())),
        in_place=out.in_place,
    )


def _keep(db: Database, cache_id: int, clock: Clock | None) -> None:
    """After a run that carried its plan out: the cost policy's clock kept, and the index's
    reserve (given back to commit on a full disk) made again if there is room."""
    if clock is not None:
        keep_clock(db, cache_id, clock)
    if db.reserve is not None:
        from cachemgr.index.schema import keep_reserve

        keep_reserve(db.reserve)


def evict(
    db: Database,
    cache_id: int,
    root: str,
    limits: Limits,
    policy: str = "lru",
    dry_run: bool = False,
    now: float | None = None,
) -> EvictResult:
    """Plan and carry out eviction down to `limits`; records an 'evict' event per entry."""
    from cachemgr.evict.execute import exclusive

    now = time.time() if now is None else now
    with exclusive(root) as r:  # planned and carried out under one lock: no entry is taken twice
        p, rows = make_plan(db, cache_id, r, limits, policy, now)
        return carry_out(db, cache_id, r, p, rows, limits.grace, dry_run, now)


def purge_plan(
    rows: Sequence[Row], chosen: Sequence[int], now: float, grace: float, include_pinned: bool = False
) -> Plan:
    return select(rows, chosen, now, grace, include_pinned)
