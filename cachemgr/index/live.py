"""Apply what the file watcher saw to the index: changed paths and read-only opens (hits).

The watcher hands over one debounced batch: paths that were written, created, moved or deleted,
directories that appeared or went away, and the files that were opened for reading (in order).
Only the entries those touch are re-stat'ed and reconciled (`scan.sync`, then `scan.parse_pending`
for the new and changed ones: the same code as a full scan), and the reads become hits.

Hits: Inductor's fxgraph and AOTAutograd caches keep several entries under one key (one per
guard set) and a lookup reads them in order until one's guards pass, so within one key
directory only the last entry read is the one used; if the key gained a new entry in the same
batch, the reads were a miss. Other kinds count a hit per read of any of their files.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Row, bindparam, delete, insert, select, update

from cachemgr import layout, safefs
from cachemgr.index.db import Database
from cachemgr.index.dbapi import chunks
from cachemgr.index.models import Event
from cachemgr.index.pending import ParseResult
from cachemgr.index.scan import (
    ENTRIES,
    KNOWN_COLUMNS,
    at_or_below,
    check_root,
    once_more_on_race,
    one_of,
    parse_pending,
    sync,
)
from cachemgr.index.workers import Pool
from cachemgr.vocab import Kind

EVENTS = Event.__table__
GUARDED = (Kind.FXGRAPH, Kind.AOTAUTOGRAD)  # kinds whose lookups try candidates in order
# The events table stays bounded whatever reads the cache sees (a loop reading one entry wrote
# 12,000 rows a second, 3 MB a second, for as long as it ran): at most HIT_EVENTS 'hit' events per
# entry per batch (its hit_count takes every read), and, kept per cache, the newest MAX_EVENTS
# events of the last EVENTS_KEPT seconds (`stats --window`, `explain --since` read them).
HIT_EVENTS = 16
MAX_EVENTS = 200_000
EVENTS_KEPT = 90 * 86400.0


@dataclass(frozen=True)
class LiveResult:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)  # entry key -> hits applied
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    new_events: list[dict] = field(default_factory=list)  # the 'new' events written (fxgraph)
    seconds: float = 0.0


def apply_batch(
    db: Database,
    cache_id: int,
    root: str,
    paths: Iterable[str] = (),
    dirs: Iterable[str] = (),
    reads: Sequence[str] = (),
    pool: Pool | None = None,
) -> LiveResult:
    """Reconcile the entries under `paths` (files) and `dirs` (whole subtrees), read the new and
    changed ones, then count `reads`.

    All paths are relative to `root`, '/'-separated. Transient paths are ignored. If another
    writer (a `cachemgr scan`) indexed some of the same new entries first, the write fails on a
    unique key, rolls back, and the batch is read again once.
    """
    return once_more_on_race(_apply_batch, db, cache_id, root, list(paths), list(dirs), reads, pool)


def _apply_batch(
    db: Database, cache_id: int, root: str, paths: list[str], dirs: list[str], reads: Sequence[str], pool: Pool | None
) -> LiveResult:
    t0 = time.monotonic()
    check_root(root)
    classified = {c.key: c for c in map(layout.classify, {layout.key_of(p) for p in paths}) if c is not None}
    subtrees = sorted({k for d in dirs if (k := layout.key_of(d.strip("/"))) and layout.classify(k) is not None})
    with safefs.Root(root) as r:
        mounts = frozenset(layout.key_of(m) for m in safefs.mounts_below(r))  # (not the cache's: as gone)
        shown = (c for k, c in classified.items() if not (mounts and safefs.at_or_below_a_mount(k, mounts)))
        folders: dict[str, dict[str, list[str]]] = {}  # (each <2ch>/ folder listed once a batch)
        disk = {c.key: d for c in shown if (d := layout.stat_entry(r, c, mounts, folders)) is not None}
        for sub in subtrees:
            # A kernel directory whose files were listed is stat'ed already. Any other name that
            # came as a file and a directory both (a folder swapped with a symlink, and back) is
            # walked: as a file it was an 'other' entry, and its subtree went unread.
            if not (sub in classified and classified[sub].kind == Kind.TRITON):
                disk.update((d.key, d) for d in layout.walk(r, sub))
    # A directory that is itself an entry (a Triton kernel) needs an exact lookup; others a prefix.
    exact = {sub for sub in subtrees if layout.is_kernel_dir(sub)}
    with db.engine.connect() as conn:  # read outside the write (see scan._sync_dirs)
        keys = list(set(classified) | set(disk) | exact)
        known: dict[str, Row] = {}
        for chunk in chunks(keys):
            known.update(
                (r.key, r)
                for r in conn.execute(
                    select(*KNOWN_COLUMNS).where(ENTRIES.c.cache_id == cache_id, one_of(conn, ENTRIES.c.key, chunk))
                )
            )
        for sub in (s for s in subtrees if s not in exact):
            known.update(
                (r.key, r)
                for r in conn.execute(
                    select(*KNOWN_COLUMNS).where(ENTRIES.c.cache_id == cache_id, at_or_below(conn, ENTRIES.c.key, sub))
                )
            )
    with db.engine.begin() as conn:
        diff = sync(conn, cache_id, disk, known, time.time())
    parsed = parse_pending(db, cache_id, root, keys=diff.to_read, pool=pool) if diff.to_read else ParseResult()
    hits = _hits(reads, new_dirs={k.rsplit("/", 1)[0] for k in diff.added})
    with db.engine.begin() as conn:
        applied = _write_hits(conn, cache_id, hits, time.time())
    new_events = [
        {"key": e["entry_key"], "graph_key": e["graph_key"], "seconds": e["seconds"]} for e in parsed.new_events
    ]
    return LiveResult(
        diff.added, diff.changed, diff.removed, applied, parsed.corrupt, new_events, time.monotonic() - t0
    )


def _hits(reads: Sequence[str], new_dirs: set[str]) -> dict[str, int]:
    """Entry key -> number of uses, from read-only opens in the order they happened."""
    per_file: dict[str, int] = {}
    for p in reads:
        per_file[p] = per_file.get(p, 0) + 1
    uses: dict[str, int] = {}
    last_in_dir: dict[str, tuple[str, int]] = {}  # guarded key dir -> (last entry read, lookups)
    for p in reads:
        c = layout.classify(layout.key_of(p))
        if c is None:
            continue
        if c.kind in GUARDED:
            folder = c.key.rsplit("/", 1)[0]
            if folder in new_dirs:
                continue  # the key gained an entry in this batch: these reads were a miss
            prev = last_in_dir.get(folder)
            last_in_dir[folder] = (c.key, max(per_file[p], prev[1] if prev else 0))
        else:
            uses[c.key] = max(uses.get(c.key, 0), per_file[p])
    for key, n in last_in_dir.values():
        uses[key] = uses.get(key, 0) + n
    return uses


def _write_hits(conn, cache_id: int, hits: dict[str, int], now: float) -> dict[str, int]:
    """Bump last_access and hit_count; write a 'hit' event per fxgraph use. Unknown keys are skipped."""
    if not hits:
        return {}
    rows: dict[str, Row] = {}
    for chunk in chunks(list(hits)):
        rows.update(
            (r.key, r)
            for r in conn.execute(
                select(ENTRIES.c.id, ENTRIES.c.key, ENTRIES.c.kind, ENTRIES.c.graph_key, ENTRIES.c.bytes).where(
                    ENTRIES.c.cache_id == cache_id, one_of(conn, ENTRIES.c.key, chunk)
                )
            )
        )
    if not rows:
        return {}
    conn.execute(
        update(ENTRIES)
        .where(ENTRIES.c.id == bindparam("b_id"))
        .values(last_access=now, hit_count=ENTRIES.c.hit_count + bindparam("b_n")),
        [{"b_id": r.id, "b_n": hits[k]} for k, r in rows.items()],
    )
    events = [
        {
            "cache_id": cache_id,
            "ts": now,
            "kind": "hit",
            "entry_kind": r.kind,
            "entry_key": k,
            "graph_key": r.graph_key,
            "recompile": False,
            "bytes": r.bytes,
            "seconds": None,
        }
        for k, r in rows.items()
        if r.kind == "fxgraph"
        for _ in range(min(hits[k], HIT_EVENTS))
    ]
    if events:
        conn.execute(insert(EVENTS), events)
        prune_events(conn, cache_id, now)
    return {k: hits[k] for k in rows}


def prune_events(conn, cache_id: int, now: float) -> None:
    """Delete the cache's events older than EVENTS_KEPT, and those older than its newest
    MAX_EVENTS (by time, through the (cache_id, ts) index: by id, the cache's events were sorted
    on every batch, 0.1 s at 200,000). Events of the same second as the last kept stay too."""
    conn.execute(delete(EVENTS).where(EVENTS.c.cache_id == cache_id, EVENTS.c.ts < now - EVENTS_KEPT))
    oldest_kept = conn.execute(
        select(EVENTS.c.ts)
        .where(EVENTS.c.cache_id == cache_id)
        .order_by(EVENTS.c.ts.desc())
        .offset(MAX_EVENTS - 1)
        .limit(1)
    ).scalar()
    if oldest_kept is not None:
        conn.execute(delete(EVENTS).where(EVENTS.c.cache_id == cache_id, EVENTS.c.ts < oldest_kept))
