"""Reconcile the index with the directory: new, changed and removed entries.

The bulk path is SQLAlchemy Core over the ORM's tables (executemany), not ORM objects. A rescan
reads only the directories whose mtime moved since they were last read (the `dirs` table), so an
unchanged tree costs one stat per directory; `full` stats every file. Files are never read
except those of new and changed entries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import bindparam, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from cachemgr import layout, parse
from cachemgr.index.db import Database
from cachemgr.index.describe import Described, Parts, describe_all
from cachemgr.index.models import (
    Cache, ComponentSet, ComponentSetItem, Dir, Entry, EntryComponentSet, EntryRef, Event,
)
from cachemgr.index.result import ScanResult, check_root

ENTRIES, REFS, EVENTS, DIRS = Entry.__table__, EntryRef.__table__, Event.__table__, Dir.__table__
SETS, SET_ITEMS, ENTRY_SETS = ComponentSet.__table__, ComponentSetItem.__table__, EntryComponentSet.__table__
CHUNK = 500  # rows per IN (...) list: well under SQLite's and PostgreSQL's parameter limits
BULK = 2000  # entry rows per executemany

T = TypeVar("T")
Progress = Callable[[int, int], None]  # (done, total) while parsing entries


_PARSED_COLUMNS = (
    "graph_key", "signature", "signature_hash", "options_hash", "guards", "device_types", "compile_seconds",
    "torch_version", "torch_version_hash", "system_hash", "corrupt",
)


def reconcile(
    db: Database, cache_id: int, root: str, subtree: str = "", progress: Progress | None = None,
    full: bool = False,
) -> ScanResult:
    """Bring the index rows of `root` (or of one subtree) in line with the disk, in one transaction.

    Only directories whose mtime moved since the last scan are read (`layout.walk_dirs`); `full`
    reads every directory and stats every file, for file systems whose directory mtimes cannot be
    trusted, or to pick up files rewritten in place. If another process (a second scan, the
    daemon) indexes some of the same entries between our read and our write, the write fails on
    a unique key, rolls back, and the scan runs once more against what is there now.
    """
    return once_more_on_race(_reconcile, db, cache_id, root, subtree, progress, full)


def once_more_on_race(write_step: Callable[..., T], *args) -> T:
    """Run a read-then-write step; if another writer inserted the same keys between its read and
    its write (a unique key fails, the transaction rolls back), run it once more: it then reads
    their rows."""
    try:
        return write_step(*args)
    except IntegrityError:
        return write_step(*args)


def _reconcile(db: Database, cache_id: int, root: str, subtree: str, progress: Progress | None,
               full: bool) -> ScanResult:
    t0 = time.monotonic()
    check_root(root)
    sub = subtree.strip("/")
    with db.engine.connect() as conn:
        q = select(DIRS.c.path, DIRS.c.mtime_ns).where(DIRS.c.cache_id == cache_id)
        if sub:
            q = q.where(at_or_below(conn, DIRS.c.path, sub))
        stored = dict(conn.execute(q).all())
        walked = layout.walk_dirs(root, sub, None if full else stored, keep_paths=False)
        # A directory gone since the last scan is stale: its entries leave the index. One that could
        # not be read (permissions) is not gone: it and all below it keep their rows as last seen.
        mtimes = walked.mtimes | {d: m for d, m in stored.items() if d not in walked.mtimes and any(
            d == u or d.startswith(u + "/") for u in walked.unreadable)}
        stale = walked.listed | {d for d in stored if d not in mtimes}
        known = {}
        if stale:
            q = select(*KNOWN_COLUMNS, ENTRIES.c.kind).where(ENTRIES.c.cache_id == cache_id)
            if sub:
                q = q.where(below(conn, ENTRIES.c.key, sub))
            known = {r.key: r for r in conn.execute(q)
                     if r.key in walked.entries or layout.home_dir(r.key, r.kind) in stale}
        q = select(func.count()).select_from(ENTRIES).where(ENTRIES.c.cache_id == cache_id)
        indexed = conn.execute(q.where(below(conn, ENTRIES.c.key, sub)) if sub else q).scalar()
        prepared = prepare(conn, cache_id, root, walked.entries, known, progress)
    with db.engine.begin() as conn:
        corrupt = write(conn, cache_id, prepared)
        _write_dirs(conn, cache_id, stored, mtimes)
        if not sub:
            conn.execute(update(Cache.__table__).where(Cache.__table__.c.id == cache_id).values(last_scan=prepared.now))
    p = prepared
    return ScanResult(root, p.added, p.changed, p.removed, indexed - len(p.changed) - len(p.removed), corrupt,
                      time.monotonic() - t0, walked.unreadable)


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


def _write_dirs(conn, cache_id: int, stored: dict[str, int], seen: dict[str, int]) -> None:
    """Record the mtime each directory had when it was read; forget directories that are gone."""
    gone = [d for d in stored if d not in seen]
    for chunk in _chunks(gone):
        conn.execute(delete(DIRS).where(DIRS.c.cache_id == cache_id, DIRS.c.path.in_(chunk)))
    new = [{"cache_id": cache_id, "path": d, "mtime_ns": m} for d, m in seen.items() if d not in stored]
    if new:
        insert_rows(conn, DIRS, new)
    moved = [{"b_path": d, "b_mtime": m} for d, m in seen.items() if d in stored and stored[d] != m]
    if moved:
        conn.execute(update(DIRS).where(DIRS.c.cache_id == cache_id, DIRS.c.path == bindparam("b_path"))
                     .values(mtime_ns=bindparam("b_mtime")), moved)


KNOWN_COLUMNS = (ENTRIES.c.id, ENTRIES.c.key, ENTRIES.c.bytes, ENTRIES.c.files, ENTRIES.c.mtime, ENTRIES.c.last_access)


@dataclass
class Prepared:
    """The difference between some entries on disk and their index rows, parsed, ready to write."""

    now: float
    disk: dict[str, layout.DiskEntry]
    known: dict
    added: list[str]
    changed: list[str]
    removed: list[str]
    touched: list[dict]
    described: dict[str, Described]
    known_graphs: set[str]


def prepare(conn, cache_id: int, root: str, disk: dict[str, layout.DiskEntry], known: dict,
            progress: Progress | None = None) -> Prepared:
    """Diff `disk` against `known` rows (KNOWN_COLUMNS, the same set of keys seen from the index)
    and parse new and changed entries. Parsing happens outside the write transaction, so readers
    and the daemon's writes are not held up."""
    now = time.time()
    added = [k for k in disk if k not in known]
    removed = [k for k in known if k not in disk]
    changed, touched = [], []
    for k, d in disk.items():
        r = known.get(k)
        if r is None:
            continue
        if r.bytes != d.bytes or r.files != d.files or abs(r.mtime - d.mtime) > 1e-6:
            changed.append(k)
        elif max(d.atime, d.mtime) > r.last_access + 1:
            touched.append({"b_id": r.id, "b_last_access": max(d.atime, d.mtime)})

    described = describe_all(root, [disk[k] for k in added + changed], progress)
    # Graph keys of the new fxgraph entries that the index already holds: those are recompilations.
    new_graphs = list({gk for k in added if (gk := described[k].row.get("graph_key"))})
    known_graphs: set[str] = set()
    for chunk in _chunks(new_graphs):
        known_graphs.update(conn.execute(select(ENTRIES.c.graph_key).distinct().where(
            ENTRIES.c.cache_id == cache_id, ENTRIES.c.graph_key.in_(chunk))).scalars())
    return Prepared(now, disk, known, added, changed, removed, touched, described, known_graphs)


def write(conn, cache_id: int, p: Prepared) -> list[tuple[str, str]]:
    """Apply a prepared diff inside the caller's transaction; return the corrupt (key, reason)s."""
    disk, known, described, now = p.disk, p.known, p.described, p.now
    delete_entries(conn, [known[k].id for k in p.removed])
    changed_ids = [known[k].id for k in p.changed]
    replaced = _sets_of(conn, changed_ids)  # component sets the changed entries had: kept while still used
    if p.touched:
        conn.execute(
            update(ENTRIES).where(ENTRIES.c.id == bindparam("b_id")).values(last_access=bindparam("b_last_access")),
            p.touched,
        )
    if p.changed:
        for chunk in _chunks(changed_ids):
            conn.execute(delete(REFS).where(REFS.c.entry_id.in_(chunk)))
            conn.execute(delete(ENTRY_SETS).where(ENTRY_SETS.c.entry_id.in_(chunk)))
        conn.execute(
            update(ENTRIES).where(ENTRIES.c.id == bindparam("b_id")).values(
                {c: bindparam("b_" + c) for c in ("bytes", "files", "mtime", "alias", *_PARSED_COLUMNS)}
            ),
            [
                {"b_id": known[k].id, "b_bytes": disk[k].bytes, "b_files": disk[k].files, "b_mtime": disk[k].mtime,
                 **{"b_" + c: described[k].row.get(c) for c in ("alias", *_PARSED_COLUMNS)}}
                for k in p.changed
            ],
        )
    for chunk in _chunks(p.added, BULK):  # rows built a chunk at a time: a first scan's peak memory stays flat
        insert_rows(conn, ENTRIES, [_new_row(cache_id, disk[k], described[k].row, now) for k in chunk])
    ids = _ids_of(conn, cache_id, p.added)
    ids.update({k: known[k].id for k in p.changed})
    refs, entry_sets, events, corrupt = [], [], [], []
    sets = ComponentSets(conn, [described[k].parts for k in p.added + p.changed])
    for k in p.added + p.changed:
        desc, eid = described[k], ids[k]
        refs.extend({"entry_id": eid, "kind": kind, "ref": ref} for kind, ref in desc.refs)
        entry_sets.extend({"entry_id": eid, "part": part, "set_id": set_id}
                          for part, set_id in sets.ids_for(desc.parts).items())
        if desc.row.get("corrupt"):
            corrupt.append((k, desc.row["corrupt"]))
    known_graphs = set(p.known_graphs)
    for k in p.added:
        d, row = disk[k], described[k].row
        if d.kind == "fxgraph" and not row.get("corrupt"):
            gk = row.get("graph_key")
            events.append({"cache_id": cache_id, "ts": d.mtime, "kind": "new", "entry_kind": d.kind,
                           "entry_key": k, "graph_key": gk, "recompile": gk in known_graphs,
                           "bytes": d.bytes, "seconds": row.get("compile_seconds")})
            known_graphs.add(gk)
    sets.flush()
    for table, rows in ((REFS, refs), (ENTRY_SETS, entry_sets), (EVENTS, events)):
        insert_rows(conn, table, rows)
    _drop_unused_sets(conn, replaced)
    return corrupt


def delete_entries(conn, ids: list[int]) -> None:
    """Delete entry rows (their refs and component-set links go with them: ON DELETE CASCADE)
    and the component sets no other entry uses any more."""
    sets = _sets_of(conn, ids)
    for chunk in _chunks(ids):
        conn.execute(delete(ENTRIES).where(ENTRIES.c.id.in_(chunk)))
    _drop_unused_sets(conn, sets)


def _sets_of(conn, entry_ids: list[int]) -> set[int]:
    out: set[int] = set()
    for chunk in _chunks(entry_ids):
        out.update(conn.execute(select(ENTRY_SETS.c.set_id).where(ENTRY_SETS.c.entry_id.in_(chunk))).scalars())
    return out


def _drop_unused_sets(conn, set_ids: set[int]) -> None:
    """Of these component sets, delete those no entry links to (only these are looked at: an
    index of many thousand sets is not scanned for each batch)."""
    for chunk in _chunks(sorted(set_ids)):
        conn.execute(delete(SETS).where(
            SETS.c.id.in_(chunk), ~select(ENTRY_SETS.c.set_id).where(ENTRY_SETS.c.set_id == SETS.c.id).exists()))


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
            self.known.update(conn.execute(select(SETS.c.digest, SETS.c.id).where(SETS.c.digest.in_(chunk))).all())
        self.pending: list[tuple[str, list[parse.Component]]] = []

    def ids_for(self, parts: Parts) -> dict[str, int]:
        out = {}
        for part, (digest, _) in parts.items():
            if digest not in self.known:
                items = self.items.get(digest)
                if items is None:  # a describer counted it as sent in a run that wrote nothing: not stored
                    continue
                self.known[digest] = self.conn.execute(insert(SETS).values(digest=digest, part=part)).inserted_primary_key[0]
                self.pending.append((digest, items))
            out[part] = self.known[digest]
        return out

    def flush(self) -> None:
        rows = [{"set_id": self.known[d], "name": c.name, "hash": c.hash, "value": c.value}
                for d, items in self.pending for c in items]
        insert_rows(self.conn, SET_ITEMS, rows)
        self.pending.clear()


def insert_rows(conn, table, rows: list[dict]) -> None:
    """INSERT many rows, all with the keys of the first. On SQLite the rows go to the driver's
    executemany as tuples: SQLAlchemy's per-row parameter processing cost more than SQLite's own
    inserts (a first scan of 100,000 files spent 0.5 s in it)."""
    if not rows:
        return
    if conn.dialect.name != "sqlite":
        conn.execute(insert(table), rows)
        return
    names = list(rows[0])
    quote = conn.dialect.identifier_preparer.quote
    sql = f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, names))}) VALUES ({', '.join('?' * len(names))})"
    conn.exec_driver_sql(sql, [tuple([r[n] for n in names]) for r in rows])


def _ids_of(conn, cache_id: int, keys: list[str]) -> dict[str, int]:
    """key -> id of entries just inserted. (INSERT ... RETURNING with many rows is several times
    slower than this on psycopg, and so are many IN lists there: past a few lists, read the
    cache's ids whole.)"""
    if len(keys) > CHUNK * 4:
        wanted = set(keys)
        return {key: eid for eid, key in conn.execute(
            select(ENTRIES.c.id, ENTRIES.c.key).where(ENTRIES.c.cache_id == cache_id)) if key in wanted}
    out: dict[str, int] = {}
    for chunk in _chunks(keys):
        out.update((k, i) for i, k in conn.execute(
            select(ENTRIES.c.id, ENTRIES.c.key).where(ENTRIES.c.cache_id == cache_id, ENTRIES.c.key.in_(chunk))))
    return out


def _new_row(cache_id: int, d: layout.DiskEntry, row: dict, now: float) -> dict:
    return {
        "cache_id": cache_id, "key": d.key, "dir": layout.home_dir(d.key, d.kind), "kind": d.kind, "ref": d.ref,
        "bytes": d.bytes, "files": d.files,
        "mtime": d.mtime, "first_seen": now, "last_access": max(d.atime, d.mtime), "hit_count": 0,
        **{c: row.get(c) for c in ("alias", *_PARSED_COLUMNS)},
    }


def _chunks(items: list, n: int = CHUNK) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]
