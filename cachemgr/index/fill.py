"""A first scan's phase one into an embedded SQLite index with no entries (the first fill), and
the walk it shares with a full scan. SQLAlchemy-free: over the standard library's sqlite3.

A first fill writes every entry of the tree in one transaction, with those of the entries
table's indexes that take every row dropped at its start and made again, from their own DDL, at
its end: SQLite builds an index from all the rows at once faster than it keeps it up row by row
(218,000 entries inserted here: 3.3 -> 2.5 s with the collector on, 2.7-3.1 -> 2.6 s with it
paused, as a scan now runs; the commit without a checkpoint saves 0.4 s more). DDL is
transactional: a scan stopped midway leaves the index as it was, indexes and all. The write lock
is held from the walk's start (another writer waits, busy_timeout), so nobody else writes
meanwhile.

`first_scan` does it, and phase two after it (cachemgr.index.pending, over the same stdlib
connection), in a process that has not imported SQLAlchemy (`cachemgr scan` on the embedded
default: its import and the ORM's cost a third of a first scan's time to a usable index on 2
cores); `scan.index_names` does it through the connection under SQLAlchemy's (the daemon).
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from cachemgr import layout, procs, safefs
from cachemgr.index import schema
from cachemgr.index.describe import Describer, prepare_unseen_reads
from cachemgr.index.result import ScanResult, check_root
from cachemgr.index.workers import WALK, WALK_READ, Job, Pool
from cachemgr.vocab import PARSED, PENDING_NEW, PICKLED, READER, Kind

if TYPE_CHECKING:
    from cachemgr.index.pending import Progress

CHUNK = 500  # directories per phase-one batch at most
BULK = 2000  # entries per phase-one batch (and per executemany)
MAX_REPORTED = 1000  # corrupt entries and new keys a result lists (the counts are whole)
# Kinds whose file name is the hash of the file's bytes (a precompile entry's is always 'entry'):
# their parse results are kept, and shared, by that name and the size.
CONTENT_NAMED = frozenset({Kind.FXGRAPH, Kind.AOTAUTOGRAD})

NEW_ROW = (
    "cache_id",
    "key",
    "dir",
    "kind",
    "ref",
    "bytes",
    "files",
    "mtime",
    "first_seen",
    "last_access",
    "hit_count",
    "parse_state",
    "content",
)  # a new entry's columns (the parsed ones stay NULL until phase two)
_COLUMNS = ", ".join('"' + c + '"' for c in ("id", *NEW_ROW))  # (quoted: 'key' is a keyword)
INSERT_ENTRY = f"INSERT INTO entries ({_COLUMNS}) VALUES ({', '.join('?' * (1 + len(NEW_ROW)))})"
INSERT_REF = "INSERT INTO entry_refs (entry_id, kind, ref) VALUES (?, ?, ?)"
# (an upsert: a directory written with one batch may be settled RACY at the walk's end, having
# lost a subfolder or holding a mount point)
INSERT_DIR = (
    "INSERT INTO dirs (cache_id, path, mtime_ns) VALUES (?, ?, ?)"
    " ON CONFLICT (cache_id, path) DO UPDATE SET mtime_ns = excluded.mtime_ns"
)

PARALLEL_WALK = 256  # walk units (kernel directories, module folders...) below which a walk stays here
WALK_JOB = (16, 512)  # fewest and most units per worker job
WALK_AHEAD = 8192  # units out at the workers or waiting: memory bounded whatever the number of cores


def first_scan(
    path: str, host: str, root: str, pool: Pool | None, create_folder: bool, progress: Progress | None = None
) -> ScanResult | None:
    """The first scan of `root` into the SQLite index at `path` (made here if it is new), both
    phases, without SQLAlchemy. None where it is not a first fill (the index holds entries, is
    at another revision or is not cachemgr's, or phase one fails): `scan.reconcile` then does
    the work, and says what is wrong where something is."""
    from cachemgr.index.dbapi import OverSqlite  # (phase two imports this module)
    from cachemgr.index.pending import parse_pending

    check_root(root)  # (before the index is made: a missing root makes none)
    prepare_unseen_reads(root)
    conn = schema.open_at_head(path, create_folder)
    if conn is None:
        return None
    try:
        try:
            conn.execute("INSERT INTO caches (host, root) VALUES (?, ?) ON CONFLICT DO NOTHING", (host, root))
            (cache_id,) = conn.execute("SELECT id FROM caches WHERE host = ? AND root = ?", (host, root)).fetchone()
            result = first_fill(conn, cache_id, root, pool)
        except sqlite3.Error:
            return None  # (rolled back: the index as it was)
        if result is None or not result.pending:
            return result
        return result.with_parsed(parse_pending(OverSqlite(conn), cache_id, root, progress, pool))
    finally:
        conn.close()


def first_fill(conn, cache_id: int, root: str, pool: Pool | None) -> ScanResult | None:
    """Phase one into an index with no entries at all (of any cache) and no directory of this
    cache, over `conn`, a DB-API SQLite connection (see the module's doc). None, with nothing
    written, where the index is not that empty (another scan may have come first). The caller
    has checked the root and made its trash folder (`prepare_unseen_reads`) before any walk."""
    t0 = time.monotonic()
    conn.execute("BEGIN IMMEDIATE")
    try:
        if (
            conn.execute("SELECT 1 FROM entries LIMIT 1").fetchone() is not None
            or conn.execute("SELECT 1 FROM dirs WHERE cache_id = ? LIMIT 1", (cache_id,)).fetchone() is not None
        ):
            conn.execute("ROLLBACK")
            return None
        # (a partial index, WHERE column IS NOT NULL, takes few of a first scan's rows: kept)
        made = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'entries'"
            " AND sql IS NOT NULL AND sql NOT LIKE '% WHERE %'"
        ).fetchall()
        for name, _ in made:
            conn.execute('DROP INDEX "{}"'.format(name.replace('"', '""')))
        state = layout.DirWalk({}, 0, {})
        added, parsed, new_keys = 0, 0, list[str]()
        now = time.time()
        read: dict[str, list[tuple[str, str]]] = {}  # the walk's reads (describe.read_with_walk), by key
        ids = itertools.count(1)  # (the entries table is empty, and stays ours until the commit)
        with procs.collector_paused():
            for batch in batches(walk(root, state, pool, read)):
                # The mtimes seen so far are those of directories whose listings are in this batch
                # or an earlier one (the walk records a directory's mtime just before its listing):
                # written with this batch's entries, never before them. Then forgotten.
                seen, state.mtimes = state.mtimes, {}
                entries = [e for listing in batch for e in listing.entries]
                parsed += insert_batch(conn, cache_id, entries, seen, now, read, ids)
                added += len(entries)
                pickled = (e.key for e in entries if e.kind in PICKLED)
                new_keys.extend(itertools.islice(pickled, MAX_REPORTED - len(new_keys)))
            state.settle()  # (the walk is whole: the containers' mtimes, now that their units are in)
            insert_batch(conn, cache_id, [], state.mtimes, now, read, ids)
        # (its entries are read by these readers: none was read by another, as on a rescan)
        conn.execute("UPDATE caches SET last_scan = ?, reader = ? WHERE id = ?", (now, READER, cache_id))
        for _, ddl in made:
            conn.execute(ddl)
        (pending,) = conn.execute(
            "SELECT COUNT(*) FROM entries WHERE cache_id = ? AND parse_state <> ?", (cache_id, PARSED)
        ).fetchone()
        # Commit without checkpointing the WAL (every page of the new index, copied into the
        # database file: 0.4 s of 2.5 at a million files here): the index is usable as it is,
        # and the next commit that checkpoints (phase two's first), or the close of the last
        # connection to it, copies it.
        (pages,) = conn.execute("PRAGMA wal_autocheckpoint").fetchone()
        conn.execute("PRAGMA wal_autocheckpoint=0")
        try:
            conn.execute("COMMIT")
        finally:  # (the connection as it was)
            conn.execute(f"PRAGMA wal_autocheckpoint={int(pages)}")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return ScanResult(
        root,
        added=added,
        seconds=time.monotonic() - t0,
        unreadable=state.unreadable,
        pending=pending,
        parsed=parsed,
        new_keys=new_keys,
        mounted=state.mounted,
    )


def insert_batch(
    conn,
    cache_id: int,
    entries: list[layout.DiskEntry],
    seen: dict[str, int],
    now: float,
    read: dict[str, list[tuple[str, str]]],
    ids: Iterator[int],
) -> int:
    """Rows of new entries (numbered from `ids`), those the walk read (`read`: taken from it)
    parsed, with their references; and the mtimes of the directories they were listed in.
    Returns how many were read."""
    parsed = 0
    for i in range(0, len(entries), BULK):
        rows: list[tuple] = []
        refs: list[tuple] = []
        for e in entries[i : i + BULK]:
            entry_id = next(ids)
            found = read.pop(e.key, None)
            rows.append((entry_id, *new_row(cache_id, e, now, parsed=found is not None)))
            if found is not None:
                parsed += 1
                refs.extend((entry_id, kind, ref) for kind, ref in found)
        conn.executemany(INSERT_ENTRY, rows)
        conn.executemany(INSERT_REF, refs)
    conn.executemany(INSERT_DIR, [(cache_id, d, m) for d, m in seen.items()])
    return parsed


def new_row(cache_id: int, d: layout.DiskEntry, now: float, parsed: bool = False) -> tuple:
    """The NEW_ROW values of a new entry (a tuple, not a dict: a first scan makes one per entry);
    `parsed`: its files were read already (by the walk), so it is not left pending."""
    return (
        cache_id,
        d.key,
        layout.home_dir(d.key, d.kind),
        d.kind,
        d.ref,
        d.bytes,
        d.files,
        d.mtime,
        now,
        max(d.atime, d.mtime),
        0,
        PENDING_NEW if d.needs_reading and not parsed else PARSED,
        d.key.rpartition("/")[2][:64] if d.kind in CONTENT_NAMED else None,
    )


def batches(listings: Iterator[layout.Listing]) -> Iterator[list[layout.Listing]]:
    """Listings grouped so one batch holds about BULK entries (or CHUNK directories)."""
    batch: list[layout.Listing] = []
    n = 0
    for listing in listings:
        batch.append(listing)
        n += len(listing.entries)
        if n >= BULK or len(batch) >= CHUNK:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def walk(
    root: str, state: layout.DirWalk, pool: Pool | None, read: dict[str, list[tuple[str, str]]] | None = None
) -> Iterator[layout.Listing]:
    """`layout.iter_dirs` over the whole tree, with the units below its top folders (Triton
    kernel directories, graph-prefix and module folders) walked by the pool's workers when there
    are many: handed out in key order, taken back in the same order, so the listings come as a
    walk in this process gives them. A job whose worker fails is walked here. With `read`, the
    entries describe.READ_WITH_WALK names are read beside the walk, and their references put in
    `read` (by key) before their listing comes. The containers' mtimes are held in `state` until
    its caller, having written every listing, settles it (`DirWalk.settle`)."""
    try:
        r = safefs.Root(root)
    except OSError:  # iter_dirs says what it can of a root that will not open
        yield from layout.iter_dirs(root, "", None, keep_paths=False, state=state)
        return
    describer = Describer()

    def here(listings: Iterator[layout.Listing]) -> Iterator[layout.Listing]:  # walked in this process
        for listing in listings:
            if read is not None:
                read.update(describer.read_with_walk(r, [listing]))
            yield listing

    with r:
        units: list[str] = []
        starting = pool if pool is not None and pool.size >= 2 else None
        for listing in here(layout.iter_dirs(r, "", None, False, state, units=units)):
            yield listing
            if starting is not None and len(units) >= PARALLEL_WALK:  # they boot while this walk goes on
                starting.start()
                starting = None
        if pool is None or len(units) < PARALLEL_WALK or pool.size < 2:
            for unit in units:
                yield from here(layout.iter_dirs(r, unit, None, False, state))
            return
        ahead = 2 * pool.size  # jobs handed out and not yet taken back: their results are held here
        per = max(WALK_JOB[0], min(WALK_JOB[1], len(units) // (pool.size * 8), WALK_AHEAD // ahead))
        groups = enumerate(_unit_groups(units, per))
        with pool.stream(lambda job, why: None, backlog=ahead) as stream:
            jobs: deque[Job] = deque()
            got: dict[int, object] = {}
            while True:
                while len(jobs) < ahead and (g := next(groups, None)) is not None:
                    jobs.append(Job(g[0], 0, root, WALK if read is None else WALK_READ, "", None, tuple(g[1]), r.id))
                    stream.submit([jobs[-1]])
                if not jobs:
                    return
                job = jobs.popleft()
                while job.id not in got:
                    done, result = stream.get()
                    got[done.id] = result
                result = got.pop(job.id)
                if not isinstance(result, tuple):  # the worker died, ran out of time, or saw another root
                    for unit in job.items:
                        yield from here(layout.iter_dirs(r, unit, None, False, state))
                    continue
                listings, seen = result[:2]
                if read is not None:
                    read.update(result[2])
                del result
                yield from listings
                del listings
                # (after its listings: a directory's mtime is never handed on before its entries)
                state.mtimes.update(seen.mtimes)
                state.listed += seen.listed
                state.unreadable.extend(seen.unreadable)
                state.lost |= seen.lost
                state.mounted.extend(seen.mounted)


def _unit_groups(units: list[str], per: int) -> Iterator[list[str]]:
    """Walk units in order, `per` to a job; a folder of the root (generated modules, thousands
    of files) is a job of its own. Takes the units out of `units` as it goes: a unit's name is
    then held by its job only (a million-file cache has 113,000 kernel directories)."""
    units.reverse()
    group: list[str] = []
    while units:
        unit = units.pop()
        if "/" not in unit:
            if group:
                yield group
                group = []
            yield [unit]
            continue
        group.append(unit)
        if len(group) >= per:
            yield group
            group = []
    if group:
        yield group
