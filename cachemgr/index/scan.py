"""Reconcile the index with the directory, in two phases.

Phase one (`index_names`): walk the tree (only directories whose mtime moved since the last scan,
or every one with `full`) and, a batch of directories at a time, bring their index rows in line
with what lstat says: new entries inserted, changed ones updated, gone ones deleted. No file is
read, so after phase one every file is counted and the index is usable; entries whose files say
more than their names (graph pickles, autotune results, C++ kernel sources) are left *pending*.
Memory stays flat: one batch of directories is held at a time, never the tree. A first scan
into an empty SQLite index is a first fill (cachemgr.index.fill: one transaction, over stdlib
sqlite3, which `cachemgr scan` runs before it imports SQLAlchemy); its walk also reads the
autotune results (small JSON files), so they are not left pending.

Phase two (`parse_pending`): read the pending entries. A parse result is kept by the entry
file's content name and size (`parsed_content`: torch names fxgraph and AOTAutograd files by the
hash of their bytes), so an entry seen before, here or on any host of a fleet index, is not read
again; the rest go through the parse workers (cachemgr.index.workers). Fields, references and
hash components are written, and a 'new' event for each newly compiled graph.

The bulk path is SQLAlchemy Core over the ORM's tables (executemany), not ORM objects. If another
process (a second scan, the daemon) indexes some of the same entries between a batch's read and
its write, the write fails on a unique key, rolls back, and that batch runs once more.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    MetaData,
    Row,
    String,
    Table,
    bindparam,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError

from cachemgr import layout, parse, procs, safefs
from cachemgr.errors import DatabaseError
from cachemgr.index import fill
from cachemgr.index.db import Database
from cachemgr.index.describe import Described, Parts, failed, new_run, prepare_unseen_reads
from cachemgr.index.models import (
    Cache,
    ComponentSet,
    ComponentSetItem,
    Dir,
    Entry,
    EntryComponentSet,
    EntryRef,
    Event,
    ParsedContent,
)
from cachemgr.index.result import ScanResult, check_root
from cachemgr.index.workers import BATCH, Job, Pool
from cachemgr.vocab import PARSED, PENDING, PENDING_NEW, PICKLED, Kind
from cachemgr.vocab import Event as Ev

ENTRIES, REFS, EVENTS, DIRS = Entry.__table__, EntryRef.__table__, Event.__table__, Dir.__table__
SETS, SET_ITEMS, ENTRY_SETS = ComponentSet.__table__, ComponentSetItem.__table__, EntryComponentSet.__table__
CONTENT, CACHES = ParsedContent.__table__, Cache.__table__
CHUNK = 500  # rows per IN (...) list: well under SQLite's and PostgreSQL's parameter limits
PARSE_CHUNK = 500  # pending entries read per phase-two transaction

T = TypeVar("T")
Progress = Callable[[int, int], None]  # (done, total) while parsing entries

PARSED_COLUMNS = (
    "graph_key",
    "signature",
    "signature_hash",
    "options_hash",
    "guards",
    "device_types",
    "compile_seconds",
    "torch_version",
    "torch_version_hash",
    "system_hash",
    "corrupt",
    "unrecorded",
)
WRITTEN_COLUMNS = ("alias", *PARSED_COLUMNS)  # what phase two writes of each entry it reads
KNOWN_COLUMNS = (
    ENTRIES.c.id,
    ENTRIES.c.key,
    ENTRIES.c.kind,
    ENTRIES.c.bytes,
    ENTRIES.c.files,
    ENTRIES.c.mtime,
    ENTRIES.c.last_access,
)


def reconcile(
    db: Database,
    cache_id: int,
    root: str,
    subtree: str = "",
    progress: Progress | None = None,
    full: bool = False,
    parse_now: bool = True,
    pool: Pool | None = None,
) -> ScanResult:
    """Both phases: the index of `root` (or of one subtree) in line with the disk, then every
    pending entry read. With `parse_now` False only phase one runs (the daemon parses after it
    says READY). Both use the workers of `pool` (or of one started here, as many as cores)."""
    own = pool is None
    pool = pool or Pool()
    try:
        r = index_names(db, cache_id, root, subtree, full, pool)
        if not parse_now:
            return r
        p = parse_pending(db, cache_id, root, progress, pool)
        return r.with_parsed(p)
    finally:
        if own:
            pool.close()


def once_more_on_race(write_step: Callable[..., T], *args) -> T:
    """Run a read-then-write step; if another writer inserted the same keys between its read and
    its write (a unique key fails, the transaction rolls back), run it once more: it then reads
    their rows."""
    try:
        return write_step(*args)
    except IntegrityError:
        return write_step(*args)


# -- phase one ------------------------------------------------------------------------------------


@dataclass
class Diff:
    """What one phase-one write changed: keys added and changed, ids removed."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    to_read: list[str] = field(default_factory=list)  # added or changed entries left pending


@dataclass
class Counts:
    added: int = 0
    changed: int = 0
    removed: int = 0
    new_keys: list[str] = field(default_factory=list)  # pickled entries added or changed (capped)

    def add(self, d: Diff, pickled: Iterable[str]) -> None:
        self.added += len(d.added)
        self.changed += len(d.changed)
        self.removed += len(d.removed)
        self.new_keys.extend(itertools.islice(pickled, fill.MAX_REPORTED - len(self.new_keys)))


def index_names(
    db: Database, cache_id: int, root: str, subtree: str = "", full: bool = False, pool: Pool | None = None
) -> ScanResult:
    """Phase one: insert, update and delete index rows from a walk of names and lstat alone. A
    walk of the whole tree with nothing to compare against (a first or full scan) is shared with
    the workers of `pool`, if given (see `fill.walk`); a first scan into an empty SQLite index is
    `fill.first_fill`."""
    t0 = time.monotonic()
    check_root(root)
    prepare_unseen_reads(root)
    sub = subtree.strip("/")
    with db.engine.connect() as conn:
        q = select(DIRS.c.path, DIRS.c.mtime_ns).where(DIRS.c.cache_id == cache_id)
        if sub:
            q = q.where(at_or_below(conn, DIRS.c.path, sub))
        # a full walk reads every directory whatever its mtime: the stored ones stay in the database
        known = None if full else dict(conn.execute(q).all())
        empty = conn.execute(select(ENTRIES.c.id).where(ENTRIES.c.cache_id == cache_id).limit(1)).first() is None
    if empty and not sub and db.is_sqlite:  # a first fill, if nobody else wrote meanwhile
        with db.engine.connect() as conn:
            try:
                filled = fill.first_fill(conn.connection.driver_connection, cache_id, root, pool)
            except sqlite3.Error as e:  # (the driver's own: SQLAlchemy wraps only what it ran)
                raise DatabaseError(f"index database: {e}") from e
        if filled is not None:
            return filled
    state = layout.DirWalk({}, 0, {})
    counts = Counts()
    now = time.time()
    listings = (
        fill.walk(root, state, pool)
        if pool is not None and not sub and not known
        else layout.iter_dirs(root, sub, known, keep_paths=False, state=state)
    )
    dirs = _StoredDirs(known) if known is not None else _StoredDirsTable(db, q)
    with procs.collector_paused():
        try:
            for batch in fill.batches(listings):
                # The mtimes seen so far are those of directories whose listings are in this batch or an
                # earlier one (the walk records a directory's mtime just before its listing): written with
                # this batch's entries, never before them, so a rescan never trusts a directory whose
                # entries are not in the index. Then forgotten: memory holds a batch, not the tree.
                seen, state.mtimes = state.mtimes, {}
                stored = dirs.see(seen)
                disk = {e.key: e for listing in batch for e in listing.entries}
                try:
                    d = _sync_dirs(db, cache_id, batch, disk, empty, now, stored, seen)
                except IntegrityError:  # another writer indexed some of these first: read their rows, once more
                    empty = False
                    d = _sync_dirs(db, cache_id, batch, disk, empty, now, stored, seen)
                counts.add(d, (k for k in itertools.chain(d.added, d.changed) if disk[k].kind in PICKLED))
            stored = dirs.see(state.mtimes)
            # A directory gone since the last scan is stale: its entries leave the index. One that could
            # not be read (permissions) is not gone: it and all below it keep their rows as last seen.
            gone = sorted(
                d for d in dirs.unseen() if not any(d == u or d.startswith(u + "/") for u in state.unreadable)
            )
        finally:
            dirs.close()
        with db.engine.begin() as conn:
            for chunk in _chunks(gone):
                ids = list(
                    conn.execute(
                        select(ENTRIES.c.id).where(ENTRIES.c.cache_id == cache_id, one_of(conn, ENTRIES.c.dir, chunk))
                    ).scalars()
                )
                delete_entries(conn, ids)
                counts.removed += len(ids)
            _write_dirs(conn, cache_id, stored, state.mtimes, gone)
            if not sub:
                conn.execute(update(CACHES).where(CACHES.c.id == cache_id).values(last_scan=now))
                _read_again_for_a_new_reader(conn, cache_id)
            unchanged = conn.execute(_count(conn, cache_id, sub)).scalar_one() - counts.added - counts.changed
            pending = conn.execute(_count(conn, cache_id, sub).where(ENTRIES.c.parse_state != PARSED)).scalar_one()
    return ScanResult(
        root,
        counts.added,
        counts.changed,
        counts.removed,
        unchanged,
        [],
        time.monotonic() - t0,
        state.unreadable,
        pending=pending,
        new_keys=counts.new_keys,
    )


class _StoredDirs:
    """The dirs rows of the part of the tree a scan walks, as they were when it began: the
    stored mtimes of the directories a batch saw, and at the end those no batch saw (gone)."""

    def __init__(self, stored: dict[str, int]) -> None:
        self.stored, self.left = stored, set(stored)

    def see(self, paths: Iterable[str]) -> dict[str, int]:
        """The stored mtimes of `paths` (or more); they are seen."""
        self.left.difference_update(paths)
        return self.stored

    def unseen(self) -> list[str]:
        return list(self.left)

    def close(self) -> None:
        pass


SNAPSHOT = Table(
    "cachemgr_scan_dirs",
    MetaData(),
    Column("path", String(1024), primary_key=True),
    Column("mtime_ns", BigInteger),
    Column("seen", Boolean, nullable=False, server_default=text("false")),
    prefixes=["TEMPORARY"],
    sqlite_with_rowid=False,
)


SNAPSHOT_CACHE = -4096  # KiB of SQLite page cache for the snapshot's connection


class _StoredDirsTable(_StoredDirs):
    """`_StoredDirs` of a full scan, whose walk needs none of them: a copy of the rows in a
    temporary table of a connection of its own, not in this process (a million-file cache has
    120,000 directories: 25 MB as a dict and a set). Each call commits: no snapshot is held."""

    def __init__(self, db: Database, query) -> None:
        self.conn = db.engine.connect()
        self.cache_size = None
        try:
            if self.conn.dialect.name == "sqlite":  # each row is read once: a small page cache, not 8 MB
                self.cache_size = self.conn.exec_driver_sql("PRAGMA cache_size").scalar()
                self.conn.exec_driver_sql(f"PRAGMA cache_size={SNAPSHOT_CACHE}")
                self.conn.exec_driver_sql(f"PRAGMA temp.cache_size={SNAPSHOT_CACHE}")
            self.conn.execute(text(f"DROP TABLE IF EXISTS {SNAPSHOT.name}"))  # one an interrupted scan left
            SNAPSHOT.create(self.conn)
            self.conn.execute(insert(SNAPSHOT).from_select(["path", "mtime_ns"], query))
            self.conn.commit()
        except BaseException:
            self.close()
            raise

    def see(self, paths: Iterable[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        conn = self.conn
        if conn.dialect.name == "sqlite":  # the driver's own cursor: SQLAlchemy's IN expansion cost 3x the lookups
            cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            for chunk in _chunks(list(paths)):
                marks = ",".join("?" * len(chunk))
                out.update(cur.execute(f"SELECT path, mtime_ns FROM {SNAPSHOT.name} WHERE path IN ({marks})", chunk))
                cur.executemany(f"UPDATE {SNAPSHOT.name} SET seen = 1 WHERE path = ?", [(p,) for p in chunk])
            cur.close()
        else:
            for chunk in _chunks(list(paths)):
                q = select(SNAPSHOT.c.path, SNAPSHOT.c.mtime_ns).where(SNAPSHOT.c.path.in_(chunk))
                out.update(conn.execute(q).all())  # (rows: a Result has .keys(), and update took it for a mapping)
                conn.execute(update(SNAPSHOT).where(SNAPSHOT.c.path.in_(chunk)).values(seen=True))
        conn.commit()
        return out

    def unseen(self) -> list[str]:
        out = list(self.conn.execute(select(SNAPSHOT.c.path).where(~SNAPSHOT.c.seen)).scalars())
        self.conn.commit()
        return out

    def close(self) -> None:
        try:
            self.conn.rollback()
            self.conn.execute(text(f"DROP TABLE IF EXISTS {SNAPSHOT.name}"))
            self.conn.commit()
            if self.cache_size is not None:  # the pooled connection as it was, its pages let go
                self.conn.exec_driver_sql(f"PRAGMA cache_size={int(self.cache_size)}")
                self.conn.exec_driver_sql("PRAGMA shrink_memory")
        finally:
            self.conn.close()


def _read_again_for_a_new_reader(conn, cache_id: int) -> None:
    """Entries read by another version of the readers (parse.READER) are read again: an upgrade
    of cachemgr that reads more of an entry applies to the entries indexed before it."""
    (reader,) = conn.execute(select(CACHES.c.reader).where(CACHES.c.id == cache_id)).one()
    if reader == parse.READER:
        return
    conn.execute(
        update(ENTRIES)
        .where(ENTRIES.c.cache_id == cache_id, ENTRIES.c.parse_state == PARSED, ENTRIES.c.kind.in_(REREAD_KINDS))
        .values(parse_state=PENDING)
    )
    conn.execute(update(CACHES).where(CACHES.c.id == cache_id).values(reader=parse.READER))


REREAD_KINDS = sorted({*layout.READ_KINDS, Kind.CODE})  # the kinds whose rows come from reading their files


def _count(conn, cache_id: int, sub: str):
    q = select(func.count()).select_from(ENTRIES).where(ENTRIES.c.cache_id == cache_id)
    return q.where(below(conn, ENTRIES.c.key, sub)) if sub else q


def _sync_dirs(
    db: Database,
    cache_id: int,
    batch: list[layout.Listing],
    disk: dict[str, layout.DiskEntry],
    empty: bool,
    now: float,
    stored: dict[str, int],
    seen: dict[str, int],
) -> Diff:
    """Bring the rows of these directories in line with their listings, in one transaction, and
    record the mtimes `seen` (those differing from `stored`) in it.
    `disk`: the entries of the listings, by key. `empty`: the cache had no rows when the scan
    began (a first scan reads none back)."""
    known: dict[str, Row] = {}
    if not empty:  # read outside the write: a SQLite reader cannot take the write lock after another commit
        with db.engine.connect() as conn:
            for chunk in _chunks([listing.dir for listing in batch]):
                known.update(
                    (r.key, r)
                    for r in conn.execute(
                        select(*KNOWN_COLUMNS).where(ENTRIES.c.cache_id == cache_id, one_of(conn, ENTRIES.c.dir, chunk))
                    )
                )
    with db.engine.begin() as conn:
        diff = sync(conn, cache_id, disk, known, now)
        _write_dirs(conn, cache_id, stored, seen, [])
        return diff


def sync(conn, cache_id: int, disk: dict[str, layout.DiskEntry], known: dict, now: float) -> Diff:
    """Apply the difference between entries on disk and their rows (KNOWN_COLUMNS, the same set
    of entries seen from the index) inside the caller's transaction: rows of new entries, sizes
    of changed ones (which go back to pending when their files say more), gone ones deleted."""
    added = [k for k in disk if k not in known] if known else list(disk)
    removed = [known[k].id for k in known if k not in disk]
    changed, touched = [], []
    for k, r in known.items():
        d = disk.get(k)
        if d is None:
            continue
        if r.bytes != d.bytes or r.files != d.files or abs(r.mtime - d.mtime) > 1e-6:
            changed.append(d)
        elif max(d.atime, d.mtime) > r.last_access + 1:
            touched.append({"id": r.id, "last_access": max(d.atime, d.mtime)})
    delete_entries(conn, removed)
    update_rows(conn, ENTRIES, ("id",), touched)
    update_rows(
        conn,
        ENTRIES,
        ("id",),
        [
            {
                "id": known[d.key].id,
                "bytes": d.bytes,
                "files": d.files,
                "mtime": d.mtime,
                "parse_state": PENDING if d.needs_reading else PARSED,
            }
            for d in changed
        ],
    )
    for chunk in _chunks(added, fill.BULK):
        insert_tuples(conn, ENTRIES, fill.NEW_ROW, [fill.new_row(cache_id, disk[k], now) for k in chunk])
    to_read = [k for k in added if disk[k].needs_reading] + [d.key for d in changed if d.needs_reading]
    return Diff(added, [d.key for d in changed], [k for k in known if k not in disk], to_read)


def below(conn, column, sub: str):
    """`column` (a '/'-separated path) is inside the folder `sub`. SQLite runs LIKE 'sub/%' as a
    scan of every row; the same set as a range ('0' sorts right after '/') uses the index.
    PostgreSQL keeps LIKE: under a non-C collation '/' and '0' need not be neighbours."""
    if conn.dialect.name == "sqlite":
        return (column > sub + "/") & (column < sub + "0")
    return column.startswith(sub + "/", autoescape=True)


def at_or_below(conn, column, sub: str):
    """`column` is the folder `sub` itself or a path inside it."""
    return or_(column == sub, below(conn, column, sub))


def _write_dirs(conn, cache_id: int, stored: dict[str, int], seen: dict[str, int], gone: list[str]) -> None:
    """Record the mtime each directory had when it was read (those new or moved since `stored`
    was read: written over what another scan may have written meanwhile); forget directories
    that are gone."""
    for chunk in _chunks(gone):
        conn.execute(delete(DIRS).where(DIRS.c.cache_id == cache_id, one_of(conn, DIRS.c.path, chunk)))
    moved = [(cache_id, d, m) for d, m in seen.items() if stored.get(d) != m]
    for chunk in _chunks(moved, fill.BULK):
        upsert_tuples(conn, DIRS, ("cache_id", "path", "mtime_ns"), ("cache_id", "path"), chunk)


# -- phase two ------------------------------------------------------------------------------------


@dataclass
class ParseResult:
    parsed: int = 0
    from_content: int = 0  # taken from parse results kept by content, not read
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (key, reason), capped
    new_events: list[dict] = field(default_factory=list)  # the 'new' events written, for this run's caller
    seconds: float = 0.0


def parse_pending(
    db: Database,
    cache_id: int,
    root: str,
    progress: Progress | None = None,
    pool: Pool | None = None,
    keys: Iterable[str] | None = None,
    limit: int | None = None,
) -> ParseResult:
    """Phase two: read pending entries (all of them, those of `keys`, or at most `limit`), a
    chunk per transaction (entry pickles are read as no workload does: describe.read_unseen).

    Each entry file's content is read once: a parse result kept by content (`parsed_content`)
    is taken as it is, and of the pending entries that share a content name and size one is
    read and the others take its result. The workers read the next chunks while this process
    writes the last one (AHEAD chunks in flight)."""
    t0 = time.monotonic()
    out = ParseResult()
    wanted = None if keys is None else list(dict.fromkeys(keys))
    with db.engine.connect() as conn:
        q = (
            select(func.count())
            .select_from(ENTRIES)
            .where(ENTRIES.c.cache_id == cache_id, ENTRIES.c.parse_state != PARSED)
        )
        total = conn.execute(q).scalar_one() if wanted is None else len(wanted)
    total = min(total, limit) if limit is not None else total
    if not total:
        return out
    own = pool is None
    pool = pool or Pool(min(max(1, total // 8), Pool().size))
    try:
        with procs.collector_paused(), _Reader(pool, root) as reader:
            ahead: deque[_Chunk] = deque()
            for rows in _pending_rows(db, cache_id, wanted, total):
                with db.engine.connect() as conn:
                    ahead.append(reader.start(conn, rows))
                while len(ahead) > AHEAD:
                    _finish(db, cache_id, reader, ahead.popleft(), out, total, progress)
            while ahead:
                _finish(db, cache_id, reader, ahead.popleft(), out, total, progress)
    finally:
        if own:
            pool.close()
    out.seconds = time.monotonic() - t0
    return out


AHEAD = 2  # chunks handed to the workers beyond the one being written
LIGHT_BATCH = 64  # entries that are not pickles (autotune results, C++ sources) per worker job


def _pending_rows(db: Database, cache_id: int, wanted: list[str] | None, total: int) -> Iterator[Sequence[Row]]:
    """The pending rows to read, PARSE_CHUNK at a time: those of `wanted`, or new entries then
    changed ones, each in id order. (One parse state at a time, so each read is a range of the
    (cache_id, parse_state) index from the last id on: `parse_state != PARSED` made SQLite read
    every row of the cache's part of that index, and sort, for each chunk.)"""
    left = total
    cols = (
        ENTRIES.c.id,
        ENTRIES.c.key,
        ENTRIES.c.kind,
        ENTRIES.c.ref,
        ENTRIES.c.bytes,
        ENTRIES.c.content,
        ENTRIES.c.parse_state,
        ENTRIES.c.mtime,
    )
    if wanted is not None:
        for key_chunk in _chunks(wanted, PARSE_CHUNK):
            if left <= 0:
                return
            with db.engine.connect() as conn:
                rows = conn.execute(
                    select(*cols)
                    .where(
                        ENTRIES.c.cache_id == cache_id,
                        ENTRIES.c.parse_state != PARSED,
                        one_of(conn, ENTRIES.c.key, key_chunk),
                    )
                    .limit(min(PARSE_CHUNK, left))
                ).fetchall()
            if rows:
                left -= len(rows)
                yield rows
        return
    for state in (PENDING_NEW, PENDING):
        last_id = 0
        while left > 0:
            with db.engine.connect() as conn:
                rows = conn.execute(
                    select(*cols)
                    .where(
                        ENTRIES.c.cache_id == cache_id,
                        ENTRIES.c.parse_state == state,
                        ENTRIES.c.id > last_id,
                    )
                    .order_by(ENTRIES.c.id)
                    .limit(min(PARSE_CHUNK, left))
                ).fetchall()
            if not rows:
                break
            last_id = rows[-1].id
            left -= len(rows)
            yield rows


@dataclass
class _Chunk:
    rows: list
    run: int
    described: dict[int, Described]  # row id -> what is known of it so far
    jobs: dict[int, list[int]]  # job id -> the row ids its result answers (a BATCH answers several)
    copies: dict[int, list[int]]  # row id read -> row ids of the same content that take its result
    later: list = field(default_factory=list)  # rows whose content an earlier chunk reads: kept by then
    hits: int = 0


class _Reader:
    """Hands the pending entries of each chunk to the parse workers (one job per pickle, small
    entries in batches) through a Stream, and gathers their results."""

    def __init__(self, pool: Pool, root: str) -> None:
        self.root = root
        try:
            with safefs.Root(root) as r:
                self.root_id: tuple[int, int] | None = r.id
        except OSError:
            self.root_id = None  # each entry is then reported unreadable by its worker
        self.stream = pool.stream(lambda job, why: failed(why))
        self.ids = itertools.count()
        self.earlier: set[tuple[str, str, int]] = set()  # contents a chunk in flight reads
        self.got: dict[int, object] = {}  # results that came before their chunk was finished

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()

    def start(self, conn, rows) -> _Chunk:
        """Look the chunk's entries up by content, and send the rest to be read."""
        chunk = _Chunk(rows, new_run(), {}, {}, {})
        chunk.described, chunk.hits = _from_content(conn, rows)
        first: dict[tuple[str, str, int], int] = {}
        reads: list[Row] = []
        light: list[Row] = []
        for r in rows:
            if r.id in chunk.described:
                continue
            same = (r.kind, r.content, r.bytes) if r.kind in fill.CONTENT_NAMED and r.content else None
            if same is not None and same in first:
                chunk.copies[first[same]].append(r.id)
            elif same is not None and same in self.earlier:
                chunk.later.append(r)
            else:
                if same is not None:
                    first[same] = r.id
                    chunk.copies[r.id] = []
                (reads if r.kind in PICKLED else light).append(r)
        self.earlier.update(first)
        self._send(chunk, reads, light)
        return chunk

    def _send(self, chunk: _Chunk, reads: list, light: list) -> None:
        jobs = []
        for r in reads:
            jobs.append(Job(next(self.ids), chunk.run, self.root, r.kind, r.key, r.ref, (), self.root_id))
            chunk.jobs[jobs[-1].id] = [r.id]
        for i in range(0, len(light), LIGHT_BATCH):
            part = light[i : i + LIGHT_BATCH]
            jobs.append(
                Job(
                    next(self.ids),
                    chunk.run,
                    self.root,
                    BATCH,
                    "",
                    None,
                    tuple((r.kind, r.key, r.ref) for r in part),
                    self.root_id,
                )
            )
            chunk.jobs[jobs[-1].id] = [r.id for r in part]
        self.stream.submit(jobs)

    def finish(self, conn, chunk: _Chunk) -> set[int]:
        """Wait for the chunk's results; returns the ids of the rows whose files were read."""
        self._collect(chunk)
        again: list[Row] = []
        for rid, others in chunk.copies.items():
            d = chunk.described[rid]
            if d.row.get("corrupt"):  # not the content's fault, perhaps (unreadable): each is read
                again.extend(r for r in chunk.rows if r.id in set(others))
            else:
                chunk.described.update((o, d) for o in others)
                chunk.hits += len(others)
        if chunk.later:  # an earlier chunk read their content and kept it (when it parsed cleanly)
            kept, n = _from_content(conn, chunk.later)
            chunk.described.update(kept)
            chunk.hits += n
            again.extend(r for r in chunk.later if r.id not in kept)
        if again:
            self._send(chunk, again, [])
            self._collect(chunk)
        read = {rid for rids in chunk.jobs.values() for rid in rids}
        return read

    def _collect(self, chunk: _Chunk) -> None:
        waiting = [j for j in chunk.jobs if chunk.jobs[j][0] not in chunk.described]
        for j in waiting:
            while j not in self.got:
                job, result = self.stream.get()
                self.got[job.id] = result
            result = self.got.pop(j)
            rids = chunk.jobs[j]
            if isinstance(result, list) and len(result) == len(rids):
                chunk.described.update(zip(rids, result, strict=True))
            elif isinstance(result, Described):  # one entry, or a failed BATCH: each of its entries
                chunk.described.update((rid, result) for rid in rids)


def _finish(
    db: Database, cache_id: int, reader: _Reader, chunk: _Chunk, out: ParseResult, total: int, progress: Progress | None
) -> None:
    with db.engine.connect() as conn:
        read = reader.finish(conn, chunk)
    with db.engine.begin() as conn:
        _write_parsed(conn, cache_id, chunk.rows, chunk.described, read, out)
    out.from_content += chunk.hits
    out.parsed += len(chunk.rows)
    if progress:
        progress(out.parsed, total)


def _from_content(conn, rows) -> tuple[dict[int, Described], int]:
    """Described entries for the pending rows whose content was parsed before (same name and
    size), when every component set they name is still stored."""
    keyed = {(r.content, r.bytes) for r in rows if r.kind in fill.CONTENT_NAMED and r.content}
    if not keyed:
        return {}, 0
    cached = {}
    for chunk in _chunks(sorted({name for name, _ in keyed})):  # (by name: the other sizes are passed over)
        q = select(CONTENT).where(one_of(conn, CONTENT.c.name, chunk), CONTENT.c.reader == parse.READER)
        for c in conn.execute(q):
            if (c.name, c.bytes) in keyed:
                cached[(c.name, c.bytes)] = c
    digests = {d for c in cached.values() for d in (c.parts or {}).values()}
    have: set[str] = set()
    for chunk in _chunks(sorted(digests)):
        have.update(conn.execute(select(SETS.c.digest).where(one_of(conn, SETS.c.digest, chunk))).scalars())
    out = {}
    for r in rows:
        c = cached.get((r.content, r.bytes))
        if c is not None and c.kind == r.kind and set((c.parts or {}).values()) <= have:
            out[r.id] = Described(dict(c.row), [tuple(x) for x in c.refs], {p: (d, None) for p, d in c.parts.items()})
    return out, len(out)


def _write_parsed(conn, cache_id: int, rows, described: dict[int, Described], read: set[int], out: ParseResult) -> None:
    """Write what parsing said, for the rows still pending now (another process may have
    written them, or an eviction deleted them, since they were read)."""
    # SQLite: the write lock first (a no-op write; not of the key, whose change checks every child row)
    conn.execute(update(CACHES).where(CACHES.c.id == cache_id).values(last_scan=CACHES.c.last_scan))
    ids = [r.id for r in rows]
    still: dict[int, int] = {}  # id -> parse state now
    for chunk in _chunks(ids):
        still.update(
            conn.execute(
                select(ENTRIES.c.id, ENTRIES.c.parse_state).where(
                    one_of(conn, ENTRIES.c.id, chunk), ENTRIES.c.parse_state != PARSED
                )
            ).all()
        )
    rows = [r for r in rows if r.id in still]
    if not rows:
        return
    seen_before = [r.id for r in rows if still[r.id] != PENDING_NEW]  # (a new row has no refs or sets yet)
    replaced = _sets_of(conn, seen_before)  # sets a changed entry had: kept while still used
    for chunk in _chunks(seen_before):
        conn.execute(delete(REFS).where(one_of(conn, REFS.c.entry_id, chunk)))
        conn.execute(delete(ENTRY_SETS).where(one_of(conn, ENTRY_SETS.c.entry_id, chunk)))
    update_tuples(
        conn,
        ENTRIES,
        ("parse_state", *WRITTEN_COLUMNS),
        ("id",),
        [(PARSED, *map(described[r.id].row.get, WRITTEN_COLUMNS), r.id) for r in rows],
    )
    sets = ComponentSets(conn, [described[r.id].parts for r in rows])
    refs: list[tuple] = []
    entry_sets: list[tuple] = []
    for r in rows:
        d = described[r.id]
        refs.extend([(r.id, kind, ref) for kind, ref in d.refs])
        entry_sets.extend([(r.id, part, set_id) for part, set_id in sets.ids_for(d.parts).items()])
        if d.row.get("corrupt") and len(out.corrupt) < fill.MAX_REPORTED:
            out.corrupt.append((r.key, d.row["corrupt"]))
    sets.flush()
    insert_tuples(conn, REFS, ("entry_id", "kind", "ref"), refs)
    insert_tuples(conn, ENTRY_SETS, ("entry_id", "part", "set_id"), entry_sets)
    _drop_unused_sets(conn, replaced)
    events = _new_events(conn, cache_id, [r for r in rows if r.parse_state == PENDING_NEW], described)
    insert_rows(conn, EVENTS, events)
    out.new_events.extend(events[: fill.MAX_REPORTED - len(out.new_events)])
    _keep_content(conn, [r for r in rows if r.id in read], described)


def _new_events(conn, cache_id: int, new_rows, described: dict[int, Described]) -> list[dict]:
    """A 'new' event per newly compiled graph; a recompile when its graph key had an entry before."""
    graphs = [
        (r, d.row.get("graph_key"))
        for r in sorted(new_rows, key=lambda r: r.mtime)
        if r.kind == Kind.FXGRAPH and not (d := described[r.id]).row.get("corrupt")
    ]
    keys = list({gk for _, gk in graphs if gk})
    new_ids = [r.id for r, _ in graphs]
    known: set[str | None] = set()
    for chunk in _chunks(keys):
        known.update(
            conn.execute(
                select(ENTRIES.c.graph_key)
                .distinct()
                .where(
                    ENTRIES.c.cache_id == cache_id,
                    one_of(conn, ENTRIES.c.graph_key, chunk),
                    ~one_of(conn, ENTRIES.c.id, new_ids),
                )
            ).scalars()
        )
    events = []
    for r, gk in graphs:
        events.append(
            {
                "cache_id": cache_id,
                "ts": r.mtime,
                "kind": Ev.NEW,
                "entry_kind": r.kind,
                "entry_key": r.key,
                "graph_key": gk,
                "recompile": gk in known,
                "bytes": r.bytes,
                "seconds": described[r.id].row.get("compile_seconds"),
            }
        )
        known.add(gk)
    return events


def _keep_content(conn, rows, described: dict[int, Described]) -> None:
    """Keep the parse results of content-named entries that parsed cleanly, for their next copy."""
    kept = []
    for r in rows:
        d = described[r.id]
        if r.kind in fill.CONTENT_NAMED and r.content and not d.row.get("corrupt"):
            kept.append(
                {
                    "name": r.content,
                    "bytes": r.bytes,
                    "kind": r.kind,
                    "row": d.row,
                    "refs": d.refs,
                    "parts": {p: digest for p, (digest, _) in d.parts.items()},
                    "parsed_at": time.time(),
                    "reader": parse.READER,
                }
            )
    if not kept:
        return
    kept = list({(k["name"], k["bytes"]): k for k in kept}.values())
    if conn.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    else:
        from sqlalchemy.dialects.postgresql import insert as dialect_insert  # type: ignore[assignment]
    q = dialect_insert(CONTENT)
    # a result another reader version left is replaced; one of this version is as good as ours
    q = q.on_conflict_do_update(
        index_elements=[CONTENT.c.name, CONTENT.c.bytes],
        set_={c: q.excluded[c] for c in ("kind", "row", "refs", "parts", "parsed_at", "reader")},
        where=CONTENT.c.reader != parse.READER,
    )
    conn.execute(q, kept)


def forget_unused_content(conn) -> int:
    """Parse results no entry of any cache has any more."""
    return conn.execute(
        delete(CONTENT).where(~select(ENTRIES.c.id).where(ENTRIES.c.content == CONTENT.c.name).exists())
    ).rowcount


# -- shared row helpers ---------------------------------------------------------------------------


def delete_entries(conn, ids: list[int]) -> None:
    """Delete entry rows (their refs and component-set links go with them: ON DELETE CASCADE)
    and the component sets no other entry uses any more."""
    sets = _sets_of(conn, ids)
    for chunk in _chunks(ids):
        conn.execute(delete(ENTRIES).where(one_of(conn, ENTRIES.c.id, chunk)))
    _drop_unused_sets(conn, sets)


def _sets_of(conn, entry_ids: list[int]) -> set[int]:
    out: set[int] = set()
    for chunk in _chunks(entry_ids):
        q = select(ENTRY_SETS.c.set_id).where(one_of(conn, ENTRY_SETS.c.entry_id, chunk))
        out.update(conn.execute(q).scalars())
    return out


def _drop_unused_sets(conn, set_ids: set[int]) -> None:
    """Of these component sets, delete those no entry links to (only these are looked at: an
    index of many thousand sets is not scanned for each batch)."""
    for chunk in _chunks(sorted(set_ids)):
        conn.execute(
            delete(SETS).where(
                one_of(conn, SETS.c.id, chunk),
                ~select(ENTRY_SETS.c.set_id).where(ENTRY_SETS.c.set_id == SETS.c.id).exists(),
            )
        )


class ComponentSets:
    """Deduplicated component sets: an entry's components split by part, each part stored once
    per distinct content (digest) and shared by every entry that has the same one."""

    def __init__(self, conn, parts: list[Parts]) -> None:
        """`parts`: those of the entries about to be written (a describer sends a part's items
        with one entry only: they are gathered from all first); the index's other sets stay unread."""
        self.conn = conn
        self.items: dict[str, list[parse.Component]] = {}
        for entry_parts in parts:
            for digest, items in entry_parts.values():
                if items is not None:
                    self.items.setdefault(digest, items)
        digests = sorted({digest for entry_parts in parts for digest, _ in entry_parts.values()})
        self.known: dict[str, int] = {}
        for chunk in _chunks(digests):
            q = select(SETS.c.digest, SETS.c.id).where(one_of(conn, SETS.c.digest, chunk))
            self.known.update(conn.execute(q).all())
        self.pending: list[tuple[str, list[parse.Component]]] = []

    def ids_for(self, parts: Parts) -> dict[str, int]:
        out = {}
        for part, (digest, _) in parts.items():
            if digest not in self.known:
                items = self.items.get(digest)
                if items is None:  # a describer counted it as sent in a run that wrote nothing: not stored
                    continue
                made = self.conn.execute(insert(SETS).values(digest=digest, part=part))
                self.known[digest] = made.inserted_primary_key[0]
                self.pending.append((digest, items))
            out[part] = self.known[digest]
        return out

    def flush(self) -> None:
        rows = [
            {"set_id": self.known[d], "name": c.name, "hash": c.hash, "value": c.value}
            for d, items in self.pending
            for c in items
        ]
        insert_rows(self.conn, SET_ITEMS, rows)
        self.pending.clear()


def one_of(conn, column, ids: Sequence[int] | Sequence[str]):
    """`column IN ids` for a list of integers or strings. On SQLite the list is one JSON parameter
    read by json_each, so the statement is compiled once whatever its length: an expanding IN is
    compiled anew for each list (at 1,000,000 files eviction's deletes spent 0.7 s compiling them,
    and a first scan's phase two 0.5 s)."""
    if conn.dialect.name != "sqlite":
        return column.in_(ids)
    return column.in_(select(literal_column("value")).select_from(func.json_each(json.dumps(ids))))


def insert_rows(conn, table, rows: list[dict]) -> None:
    """INSERT many rows, all with the keys of the first."""
    if rows:
        names = tuple(rows[0])
        insert_tuples(conn, table, names, [tuple([r[n] for n in names]) for r in rows])


def insert_tuples(conn, table, names: Sequence[str], rows: list[tuple]) -> None:
    """INSERT many rows given as tuples of the columns `names`. On SQLite they go to the driver's
    executemany as they are: SQLAlchemy's per-row parameter processing cost more than SQLite's own
    inserts (a first scan of 100,000 files spent 0.5 s in it)."""
    if not rows:
        return
    if conn.dialect.name != "sqlite":
        conn.execute(insert(table), [dict(zip(names, r, strict=True)) for r in rows])
        return
    quote = conn.dialect.identifier_preparer.quote
    sql = f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, names))}) VALUES ({', '.join('?' * len(names))})"
    conn.exec_driver_sql(sql, rows)


def upsert_tuples(conn, table, names: Sequence[str], key: Sequence[str], rows: list[tuple]) -> None:
    """INSERT many rows given as tuples of the columns `names` (as `insert_tuples`), each updating
    the row with the same `key` columns where there is one."""
    if not rows:
        return
    if conn.dialect.name != "sqlite":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        q = pg_insert(table)
        conn.execute(
            q.on_conflict_do_update(index_elements=list(key), set_={n: q.excluded[n] for n in names if n not in key}),
            [dict(zip(names, r, strict=True)) for r in rows],
        )
        return
    quote = conn.dialect.identifier_preparer.quote
    sql = (
        f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, names))}) VALUES ({', '.join('?' * len(names))}) "
        f"ON CONFLICT ({', '.join(map(quote, key))}) DO UPDATE SET "
        f"{', '.join(f'{quote(n)} = excluded.{quote(n)}' for n in names if n not in key)}"
    )
    conn.exec_driver_sql(sql, rows)


def update_rows(conn, table, where: tuple[str, ...], rows: list[dict]) -> None:
    """UPDATE many rows, each dict naming the `where` columns' values and the new values of the
    others (all with the keys of the first)."""
    if rows:
        names = tuple(n for n in rows[0] if n not in where)
        order = names + where
        update_tuples(conn, table, names, where, [tuple([r[n] for n in order]) for r in rows])


def update_tuples(conn, table, names: Sequence[str], where: Sequence[str], rows: list[tuple]) -> None:
    """UPDATE many rows given as tuples: the new values of the columns `names`, then the values
    of the `where` columns that pick the row. On SQLite through the driver's executemany, as
    `insert_tuples`."""
    if not rows:
        return
    if conn.dialect.name != "sqlite":
        q = update(table).where(*(table.c[w] == bindparam("b_" + w) for w in where))
        order = ["b_" + n for n in (*names, *where)]
        params = [dict(zip(order, r, strict=True)) for r in rows]
        conn.execute(q.values(**{n: bindparam("b_" + n) for n in names}), params)
        return
    quote = conn.dialect.identifier_preparer.quote
    sql = (
        f"UPDATE {quote(table.name)} SET {', '.join(quote(n) + ' = ?' for n in names)} "
        f"WHERE {' AND '.join(quote(w) + ' = ?' for w in where)}"
    )
    conn.exec_driver_sql(sql, rows)


def _chunks(items: list, n: int = CHUNK) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]
