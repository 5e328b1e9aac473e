"""Reconcile the index with the directory, in two phases.

Phase one (`index_names`): walk the tree (only directories whose mtime moved since the last scan,
or every one with `full`) and, a batch of directories at a time, bring their index rows in line
with what lstat says: new entries inserted, changed ones updated, gone ones deleted. No file is
read, so after phase one every file is counted and the index is usable; entries whose files say
more than their names (graph pickles, autotune results, C++ kernel sources) are left *pending*.
Memory stays flat: one batch of directories is held at a time, never the tree. A first scan
into an empty SQLite index is a first fill (cachemgr.index.fill: one transaction, over stdlib
sqlite3; `cachemgr scan` runs it, and phase two, without importing SQLAlchemy); its walk also
reads the autotune results (small JSON files), so they are not left pending.

Phase two (`parse_pending`, cachemgr.index.pending): read the pending entries.

Phase one's bulk path is SQLAlchemy Core over the ORM's tables (executemany), not ORM objects.
If another process (a second scan, the daemon) indexes some of the same entries between a
batch's read and its write, the write fails on a unique key, rolls back, and that batch runs
once more.
"""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
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

from cachemgr import layout, parse, procs
from cachemgr.errors import DatabaseError
from cachemgr.index import fill
from cachemgr.index.db import Database
from cachemgr.index.dbapi import Sql, chunks, driver_errors
from cachemgr.index.describe import prepare_unseen_reads
from cachemgr.index.models import Cache, Dir, Entry, ParsedContent
from cachemgr.index.pending import Progress, drop_unused_sets, parse_pending, sets_of
from cachemgr.index.result import ScanResult, check_root
from cachemgr.index.store import moment
from cachemgr.index.workers import Pool
from cachemgr.vocab import PARSED, PENDING, PICKLED, Kind

ENTRIES, DIRS, CONTENT, CACHES = Entry.__table__, Dir.__table__, ParsedContent.__table__, Cache.__table__

T = TypeVar("T")
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
    except driver_errors("IntegrityError", IntegrityError):  # (phase two's SQL is the driver's)
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
            state.settle()
            stored = dirs.see(state.mtimes)
            # A directory gone since the last scan is stale: its entries leave the index. One that could
            # not be read (permissions) is not gone: it and all below it keep their rows as last seen.
            gone = sorted(
                d for d in dirs.unseen() if not any(d == u or d.startswith(u + "/") for u in state.unreadable)
            )
        finally:
            dirs.close()
        with db.engine.begin() as conn:
            for chunk in chunks(gone):
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
        mounted=state.mounted,
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
            for chunk in chunks(list(paths)):
                marks = ",".join("?" * len(chunk))
                out.update(cur.execute(f"SELECT path, mtime_ns FROM {SNAPSHOT.name} WHERE path IN ({marks})", chunk))
                cur.executemany(f"UPDATE {SNAPSHOT.name} SET seen = 1 WHERE path = ?", [(p,) for p in chunk])
            cur.close()
        else:
            for chunk in chunks(list(paths)):
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
    misfiled: dict[str, Row] = {}
    if not empty:  # read outside the write: a SQLite reader cannot take the write lock after another commit
        with db.engine.connect() as conn:
            for chunk in chunks([listing.dir for listing in batch]):
                known.update(
                    (r.key, r)
                    for r in conn.execute(
                        select(*KNOWN_COLUMNS).where(ENTRIES.c.cache_id == cache_id, one_of(conn, ENTRIES.c.dir, chunk))
                    )
                )
            # An entry of these directories whose row names another one (an edited index; a BLOB
            # there): found by its key, compared as any other, and filed where it lives. (Taken
            # for new, its row's key made every rescan fail on the unique key.)
            for chunk in chunks([k for k in disk if k not in known]):
                misfiled.update(
                    (r.key, r)
                    for r in conn.execute(
                        select(*KNOWN_COLUMNS).where(ENTRIES.c.cache_id == cache_id, one_of(conn, ENTRIES.c.key, chunk))
                    )
                )
            known.update(misfiled)
    with db.engine.begin() as conn:
        diff = sync(conn, cache_id, disk, known, now)
        refile = [{"id": r.id, "dir": layout.home_dir(k, disk[k].kind)} for k, r in misfiled.items()]
        update_rows(conn, ENTRIES, ("id",), refile)
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
        # (an odd value of an edited index, text or NaN, reads as changed: the disk's is written)
        if r.bytes != d.bytes or r.files != d.files or not abs(moment(r.mtime, math.nan) - d.mtime) <= 1e-6:
            changed.append(d)
        elif max(d.atime, d.mtime) > moment(r.last_access, -math.inf) + 1:
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
    for chunk in chunks(added, fill.BULK):
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
    for chunk in chunks(gone):
        conn.execute(delete(DIRS).where(DIRS.c.cache_id == cache_id, one_of(conn, DIRS.c.path, chunk)))
    moved = [(cache_id, d, m) for d, m in seen.items() if stored.get(d) != m]
    for rows in chunks(moved, fill.BULK):
        upsert_tuples(conn, DIRS, ("cache_id", "path", "mtime_ns"), ("cache_id", "path"), rows)


def forget_unused_content(conn) -> int:
    """Parse results no entry of any cache has any more."""
    return conn.execute(
        delete(CONTENT).where(~select(ENTRIES.c.id).where(ENTRIES.c.content == CONTENT.c.name).exists())
    ).rowcount


# -- shared row helpers ---------------------------------------------------------------------------


def delete_entries(conn, ids: list[int]) -> None:
    """Delete entry rows (their refs and component-set links go with them: ON DELETE CASCADE)
    and the component sets no other entry uses any more."""
    sql = Sql.under(conn)
    sets = sets_of(sql, ids)
    for chunk in chunks(ids):
        conn.execute(delete(ENTRIES).where(one_of(conn, ENTRIES.c.id, chunk)))
    drop_unused_sets(sql, sets)


def one_of(conn, column, ids: Sequence[int] | Sequence[str]):
    """`column IN ids` for a list of integers or strings. On SQLite the list is one JSON parameter
    read by json_each, so the statement is compiled once whatever its length: an expanding IN is
    compiled anew for each list (at 1,000,000 files eviction's deletes spent 0.7 s compiling them,
    and a first scan's phase two 0.5 s). json_each ends a string at a NUL, so a list holding one
    (a hand-edited row's) is bound as an expanding IN."""
    if conn.dialect.name != "sqlite" or (ids and isinstance(ids[0], str) and any("\0" in str(v) for v in ids)):
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
