"""The index as one read API: every question a command, the daemon's metrics, `explain` or the
fleet report asks of the index is a method of `Store`, and the SQL lives here and nowhere else.

A Store reads one cache (host + root) of an index, through one of two drivers:

- `Store.of(db, host, root)`: SQLAlchemy (SQLite or PostgreSQL), a pooled connection per query;
- `Store.sqlite(path, head, host, root)`: the standard library's sqlite3, read-only. Importing
  SQLAlchemy costs more than a whole `stats`, so on the embedded default `stats` runs on this.

Both run the same SQL text (named `:parameters`, nothing dialect-specific), so the two paths
cannot drift apart; a test holds them equal. Results are frozen dataclasses or plain dicts.

Keys: every entry has a short key, the shortest unique prefix (at least 8 characters) of the
name other entries know it by (its `ref`: a graph key, a kernel hash, a module name), as git
abbreviates commits. Entries that share a name (one graph compiled for several guard sets, one
kernel on several devices) add `/` and the shortest unique prefix of what tells them apart.
`resolve` takes that form back, and every other form a command prints.
"""

from __future__ import annotations

import bisect
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Protocol
from urllib.parse import quote

from cachemgr.errors import DatabaseError, NotFound, UsageError
from cachemgr.index.dbapi import chunks
from cachemgr.index.result import ScanResult
from cachemgr.vocab import PARSED, Event, Kind

SHORT_MIN = 8  # characters of a short key (git's --abbrev, one more)
PREFIX_MIN = 4  # the shortest prefix `resolve` looks up
CANDIDATES = 10  # ambiguous prefix: candidates listed


# -- drivers ----------------------------------------------------------------------------------------


class Driver(Protocol):
    dialect: str

    def rows(self, sql: str, params: Mapping[str, Any]) -> list[tuple]: ...
    def each(self, sql: str, params: Mapping[str, Any], batch: int = ...) -> Iterator[tuple]: ...
    def batches(self, sql: str, params: Mapping[str, Any], batch: int = ...) -> Iterator[list[tuple]]: ...
    def write(self, sql: str, params: Mapping[str, Any]) -> int: ...
    def close(self) -> None: ...


STREAM = 1000  # rows fetched at a time by `each`: memory holds these, not the result
SHAPES_STREAM = 50  # shapes rows fetched at a time: one holds up to 64 KiB of spec and 64 KiB of options


class _Sqlite3:
    """stdlib sqlite3, autocommit: each query sees the index as it is now."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def rows(self, sql: str, params: Mapping[str, Any]) -> list[tuple]:
        try:
            return self.conn.execute(sql, dict(params)).fetchall()
        except sqlite3.Error as e:
            raise DatabaseError(f"index database error: {e}") from e

    def each(self, sql: str, params: Mapping[str, Any], batch: int = STREAM) -> Iterator[tuple]:
        for part in self.batches(sql, params, batch):
            yield from part

    def batches(self, sql: str, params: Mapping[str, Any], batch: int = STREAM) -> Iterator[list[tuple]]:
        try:
            cur = self.conn.execute(sql, dict(params))
            while part := cur.fetchmany(batch):
                yield part
        except sqlite3.Error as e:
            raise DatabaseError(f"index database error: {e}") from e

    def write(self, sql: str, params: Mapping[str, Any]) -> int:
        try:
            return self.conn.execute(sql, dict(params)).rowcount
        except sqlite3.Error as e:
            raise DatabaseError(f"index database error: {e}") from e

    def close(self) -> None:
        self.conn.close()


class _Engine:
    """SQLAlchemy: a pooled connection per query; a write commits at once."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    def rows(self, sql: str, params: Mapping[str, Any]) -> list[tuple]:
        from sqlalchemy import text

        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), dict(params)).fetchall())

    def each(self, sql: str, params: Mapping[str, Any], batch: int = STREAM) -> Iterator[tuple]:
        for part in self.batches(sql, params, batch):
            yield from part

    def batches(self, sql: str, params: Mapping[str, Any], batch: int = STREAM) -> Iterator[list[tuple]]:
        with self.engine.connect() as conn:
            yield from _Connection(conn).batches(sql, params, batch)

    def write(self, sql: str, params: Mapping[str, Any]) -> int:
        from sqlalchemy import text

        with self.engine.begin() as conn:
            return conn.execute(text(sql), dict(params)).rowcount

    def close(self) -> None:
        pass  # the engine belongs to its Database


class _Connection:
    """An open SQLAlchemy connection of the caller's (its transaction, its commit)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.dialect = conn.dialect.name

    def rows(self, sql: str, params: Mapping[str, Any]) -> list[tuple]:
        from sqlalchemy import text

        return list(self.conn.execute(text(sql), dict(params)).fetchall())

    def each(self, sql: str, params: Mapping[str, Any], batch: int = STREAM) -> Iterator[tuple]:
        for part in self.batches(sql, params, batch):
            yield from part

    def batches(self, sql: str, params: Mapping[str, Any], batch: int = STREAM) -> Iterator[list[tuple]]:
        from sqlalchemy import text

        if self.dialect == "sqlite":  # the driver's own rows, on its connection (in its transaction): a
            # Row made for each cost a third of eviction's reading of 200,000 entries
            cursor = self.conn.connection.driver_connection.cursor()
            try:
                cursor.execute(sql, dict(params))
                while part := cursor.fetchmany(batch):
                    yield part
            except sqlite3.Error as e:
                raise DatabaseError(f"index database error: {e}") from e
            finally:
                cursor.close()
            return
        result = self.conn.execution_options(stream_results=True, max_row_buffer=batch).execute(text(sql), dict(params))
        for part in result.partitions(batch):
            yield list(part)

    def write(self, sql: str, params: Mapping[str, Any]) -> int:
        from sqlalchemy import text

        return self.conn.execute(text(sql), dict(params)).rowcount

    def close(self) -> None:
        pass


def open_sqlite(path: str, write: bool = False) -> sqlite3.Connection | None:
    """A stdlib connection to an existing SQLite index (None if there is none). The path goes in
    a `file:` URI percent-escaped: a '#' or '?' in it is part of the name, not of the URI."""
    if not os.path.isfile(path):
        return None
    try:
        conn = sqlite3.connect(
            f"file:{quote(path)}?mode={'rw' if write else 'ro'}", uri=True, timeout=30, isolation_level=None
        )
        conn.execute("PRAGMA busy_timeout=30000")
        return conn
    except sqlite3.Error:
        return None


def sqlite_path(url: str) -> str | None:
    """The file of a plain `sqlite:///PATH` URL: None for other databases, SQLite in memory, and
    a URL with a query (`?timeout=60`) or a %-escape, whose file only SQLAlchemy's reading of the
    URL names (read literally, `x.db?timeout=60` would be another file: a first scan filled it)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///") :]
    return None if path in ("", ":memory:") or "?" in path or "%" in path else path


# -- what the store returns -------------------------------------------------------------------------


def iso_time(ts: float | None) -> str | None:
    """UTC ISO 8601; None for no time, or one no clock can show (an edited index: text, inf)."""
    try:
        return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    except (TypeError, ValueError, OverflowError, OSError):
        return None


# The index is read as it is: a hand-edited SQLite index may hold text where a number belongs
# and bytes where text does (SQLite keeps any value in any column), and a PostgreSQL one NaN or
# Infinity in a float column. An entry's values are read through these, so one odd value is that
# entry's oddity, not a failed command.


INT64 = 1 << 63


def whole(v: Any) -> int:
    """A count or size as stored, 0 where it is none (not a number a database integer holds)."""
    if type(v) is not int:
        try:
            v = int(float(v)) if v is not None and not isinstance(v, (bytes, bool)) else 0
        except (TypeError, ValueError, OverflowError):
            return 0
    return v if -INT64 <= v < INT64 else 0


def text(v: Any) -> Any:
    """Text as stored: a BLOB where text belongs (SQLite keeps one in any column) read as UTF-8,
    its odd bytes escaped; anything else as it is."""
    return v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v


def words(v: Any) -> str | None:
    """Text where text belongs, whatever a hand edit stored there (a BLOB, a number); None kept."""
    return None if v is None else str(text(v))


def moment(v: Any, missing: float = 0.0) -> float:
    """A time (or seconds) as stored, `missing` where it is not a finite number."""
    if type(v) is float and math.isfinite(v):
        return v
    try:
        f = float(v) if v is not None and not isinstance(v, (bytes, bool)) else missing
    except (TypeError, ValueError, OverflowError):
        return missing
    return f if math.isfinite(f) else missing


# A shared index holds other hosts' rows as they wrote them, or as someone edited them. Where rows
# of many are summed (the fleet's figures, a cache's totals), a number no real cache has reads as
# unknown for that row only, so that it cannot zero, negate or swamp the sum: a size of 1 TiB or
# more (of one entry), a time outside 1970 to the year 33658 (what `age` shows), a compile of
# 1e9 s or more, a hit count past PostgreSQL's INTEGER. (SQLite's integer SUM fails past int64;
# PostgreSQL's NaN sorts above every number; text in a hand-edited SQLite index sorts above them.)
MAX_BYTES = 1 << 40
MAX_FILES = 1 << 24  # in one entry (a kernel folder holds a few): more is a hand edit's
MAX_TIME = 1e12
MAX_SECONDS = 1e9
MAX_HITS = 1 << 31


def bounded(n: int, top: float) -> int:
    """A count or size read from a row: 0 where no real cache has it (negative, or `top` or more)."""
    return n if 0 <= n < top else 0


def _known(column: str, top: float) -> str:
    """SQL: `column` where it is a number in [0, top), else NULL."""
    return f"CASE WHEN {column} >= 0 AND {column} < {top!r} THEN {column} END"


def _sum(known: str) -> str:
    """SQL: the sum of known values as a float, 0 for none (sizes below 1 TiB add exactly in a
    float up to 8 PiB)."""
    return f"COALESCE(SUM(CAST({known} AS DOUBLE PRECISION)), 0)"


_BYTES = _known("e.bytes", MAX_BYTES)


def known_time(v: Any) -> float | None:
    """A time as stored, None where it reads as unknown."""
    t = moment(v, math.nan)
    return t if 0 <= t < MAX_TIME else None


@dataclass(frozen=True)
class CacheRow:
    """One cache directory of one host in the index."""

    id: int
    host: str
    root: str
    last_scan: float | None
    last_eviction: float | None


@dataclass(frozen=True)
class Usage:
    entries: int = 0
    files: int = 0
    bytes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.entries + other.entries, self.files + other.files, self.bytes + other.bytes)


@dataclass(frozen=True)
class Totals:
    """What one cache holds, by kind."""

    root: str
    by_kind: dict[str, Usage]
    corrupt: int = 0
    pending: int = 0  # indexed from their names only, not parsed yet
    pinned: int = 0  # pins (keys eviction keeps)
    oldest: float | None = None  # mtimes
    newest: float | None = None
    last_scan: float | None = None
    last_eviction: float | None = None

    @property
    def total(self) -> Usage:
        out = Usage()
        for u in self.by_kind.values():
            out += u
        return out

    def as_dict(self) -> dict[str, Any]:
        t = self.total
        return {
            "cache_dir": self.root,
            "entries": t.entries,
            "files": t.files,
            "bytes": t.bytes,
            "corrupt": self.corrupt,
            "not_parsed": self.pending,
            "pinned": self.pinned,
            "oldest": iso_time(self.oldest),
            "newest": iso_time(self.newest),
            "by_kind": {k: asdict(u) for k, u in self.by_kind.items()},
            "last_scan": iso_time(self.last_scan),
            "last_eviction": iso_time(self.last_eviction),
        }


@dataclass(frozen=True)
class Entry:
    """One index entry, as `ls` and `show` print it."""

    id: int
    key: str
    kind: str
    ref: str | None
    alias: str | None
    bytes: int
    files: int
    mtime: float
    first_seen: float
    last_access: float
    hit_count: int
    graph_key: str | None
    signature: str | None
    signature_hash: str | None
    options_hash: str | None
    guards: str | None
    device_types: str | None
    compile_seconds: float | None
    torch_version: str | None  # the entry's own, else what a fingerprint names its torch hash
    torch_version_hash: str | None
    system_hash: str | None
    corrupt: str | None
    parse_state: int
    unrecorded: str | None  # what its torch's format does not record
    content: str | None
    pin: str | None = None  # the pinned key (its own key, graph key or ref) that covers it
    pin_reason: str | None = None

    @property
    def parsed(self) -> bool:
        return self.parse_state == PARSED

    @property
    def pinned(self) -> bool:
        return self.pin is not None

    @property
    def name(self) -> str:
        return entry_name(self.key, self.ref)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("id", "parse_state", "pin")}
        d.update(path=self.key, pinned=self.pinned, parsed=self.parsed)
        return d


def entry_name(key: str, ref: str | None) -> str:
    """What tells an entry from the others of its ref: the last part of its key that is not the
    ref (an fxgraph entry's file, a kernel's device folder), else its key."""
    return next((p for p in reversed(key.split("/")) if p and p != ref), key)


ENTRY_COLUMNS = """e.id, e.key, e.kind, e.ref, e.alias, e.bytes, e.files, e.mtime, e.first_seen, e.last_access,
COALESCE(e.hit_count, 0), e.graph_key, e.signature, e.signature_hash, e.options_hash, e.guards, e.device_types,
e.compile_seconds,
COALESCE(e.torch_version, (SELECT f.name FROM fingerprints f WHERE f.kind = 'torch' AND f.hash = e.torch_version_hash
                           ORDER BY f.last_seen DESC LIMIT 1)),
e.torch_version_hash, e.system_hash, e.corrupt, COALESCE(e.parse_state, 0), e.unrecorded, e.content"""


_TEXT = frozenset(i for i, f in enumerate(fields(Entry)[:25]) if f.type in ("str", "str | None"))  # text columns


def _entry(row: Sequence[Any], pins: Mapping[str, str | None] | None = None) -> Entry:
    row = row[:25]
    if bytes in map(type, row):  # (a test in C: `ls` makes one per entry)
        row = [text(v) if i in _TEXT else v for i, v in enumerate(row)]
    e = Entry(*row)
    seconds = None if e.compile_seconds is None else moment(e.compile_seconds, -1.0)
    # (numbers no real cache has read as unknown, as the sums read them: a table 386 columns wide)
    e = replace(
        e,
        bytes=bounded(whole(e.bytes), MAX_BYTES),
        files=bounded(whole(e.files), MAX_FILES),
        mtime=moment(e.mtime),
        first_seen=moment(e.first_seen),
        last_access=moment(e.last_access),
        hit_count=bounded(whole(e.hit_count), MAX_HITS),
        compile_seconds=seconds if seconds is not None and 0 <= seconds < MAX_SECONDS else None,
        parse_state=whole(e.parse_state),
    )
    if pins:
        pin = next((k for k in (e.key, e.graph_key, e.ref) if k and k in pins), None)
        if pin is not None:
            e = replace(e, pin=pin, pin_reason=pins[pin])
    return e


@dataclass(frozen=True)
class Filters:
    """What `ls` (and `--model` of evict and purge) narrows entries to."""

    kind: str | None = None
    older_than: float | None = None  # seconds since last access
    larger_than: int | None = None
    graphs: frozenset[str] | None = None  # graph keys (or refs): their entries only
    pinned: bool = False
    corrupt: bool = False
    locks: bool = False  # list lock files (zero bytes, Inductor's own) too
    sort: str = "size"  # size | age | cost | name
    limit: int | None = None


@dataclass(frozen=True)
class Match:
    """What a key a user typed names: entries, newest first. `ref` is set when it named a whole
    ref (a graph key, a kernel hash...): then `entries` are every entry of it."""

    spec: str
    entries: tuple[Entry, ...]
    ref: str | None = None

    @property
    def graph(self) -> str:
        """The graph key (or, for an entry of no graph, the ref or key) it names."""
        if self.ref is not None:
            return self.ref
        e = self.entries[0]
        return e.graph_key or e.ref or e.key


class AmbiguousKey(UsageError):
    """A prefix of several entries: never act on all of them."""

    def __init__(self, spec: str, candidates: Sequence[Entry], more: bool, shorts: Mapping[str, str]) -> None:
        self.spec, self.candidates, self.more, self.shorts = spec, tuple(candidates), more, dict(shorts)
        n = f"more than {len(candidates)}" if more else str(len(candidates))
        super().__init__(f"{spec!r} is ambiguous: it is a prefix of {n} keys; give more of it")


@dataclass(frozen=True)
class Pin:
    key: str
    reason: str | None
    created: float
    entries: int = 0  # index entries it covers now

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "reason": self.reason, "created": iso_time(self.created), "entries": self.entries}


@dataclass(frozen=True)
class CompileEvent:
    """A new fxgraph entry, as the events table recorded it."""

    id: int
    ts: float
    key: str
    graph_key: str | None
    seconds: float | None
    loaded: bool  # written by a load (import, remote fill, a copy): no compile happened
    entry_id: int | None  # None once the entry is gone from the index


@dataclass(frozen=True)
class GraphEntry:
    """A parsed fxgraph entry and the component sets its key was hashed from, by part."""

    id: int
    key: str
    ref: str | None
    graph_key: str | None
    mtime: float
    guards: str | None
    unrecorded: str | None
    torch_version: str | None
    sets: Mapping[str, int]  # part -> component set id; empty: its torch recorded none

    @property
    def order(self) -> tuple[float, int]:
        return (self.mtime, self.id)


Component = tuple[str, str | None]  # (hash, value)


@dataclass(frozen=True)
class ModelUsage:
    model: str
    signatures: int
    graphs: int
    entries: int
    bytes: int  # its graphs' entries, the AOT entries naming them and what those name
    hits: int
    compile_seconds: float
    last_access: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "compile_seconds": round(self.compile_seconds, 3),
            "last_access": iso_time(self.last_access),
        }


# -- the store --------------------------------------------------------------------------------------

CACHE_SQL = "SELECT id, host, root, last_scan, last_eviction FROM caches"


class Store:
    """The index of one cache (host + root), read through typed methods."""

    def __init__(self, driver: Driver, host: str, root: str, cache_id: int | None = None) -> None:
        self.driver, self.host, self.root = driver, host, root
        self._cache_id = cache_id

    # -- opening ------------------------------------------------------------------------------------

    @classmethod
    def of(cls, db: Any, host: str, root: str) -> Store:
        """Over a cachemgr.index.db.Database (the cache's row is created on first use)."""
        return cls(_Engine(db.engine), host, root, db.cache_id(host, root))

    @classmethod
    def of_index(cls, db: Any) -> Store:
        """Over a Database, for what belongs to no one cache (the recorded shapes): no cache's row
        is made."""
        return cls(_Engine(db.engine), "", "")

    @classmethod
    def of_id(cls, db: Any, cache_id: int) -> Store:
        """Over a Database, for the cache of this id (the daemon knows its cache by id)."""
        store = cls(_Engine(db.engine), "", "", cache_id)
        c = store.cache_row()
        store.host, store.root = (c.host, c.root) if c else ("", "")
        return store

    @classmethod
    def over(cls, conn: Any, cache_id: int | None = None) -> Store:
        """Over an open SQLAlchemy connection (the caller's transaction)."""
        store = cls(_Connection(conn), "", "", cache_id)
        if cache_id is not None:
            c = store.cache_row()
            store.host, store.root = (c.host, c.root) if c else ("", "")
        return store

    @classmethod
    def sqlite(cls, path: str, head: str, host: str, root: str) -> Store | None:
        """Read-only over stdlib sqlite3: None unless the index exists, is at schema `head` and
        has scanned this cache."""
        conn = open_sqlite(path)
        if conn is None:
            return None
        store = cls(_Sqlite3(conn), host, root)
        try:
            if conn.execute("SELECT version_num FROM alembic_version").fetchone() == (head,):
                c = store._find_cache(host, root)
                if c is not None and c.last_scan is not None:
                    store._cache_id = c.id
                    return store
        except (sqlite3.Error, DatabaseError):
            pass
        conn.close()
        return None

    def on(self, cache: CacheRow) -> Store:
        """The same index, another cache of it."""
        return Store(self.driver, cache.host, cache.root, cache.id)

    def close(self) -> None:
        self.driver.close()

    @property
    def dialect(self) -> str:
        return self.driver.dialect

    @property
    def cache_id(self) -> int:
        if self._cache_id is None:
            raise NotFound(f"{self.root} is not in the index (run: cachemgr scan)")
        return self._cache_id

    def _rows(self, sql: str, **params: Any) -> list[tuple]:
        return self.driver.rows(sql, {"cache": self._cache_id, **params})

    def _scalar(self, sql: str, **params: Any) -> Any:
        rows = self._rows(sql, **params)
        return rows[0][0] if rows else None

    def _chunked(self, sql: str, column: str, values: Iterable[Any], **params: Any) -> Iterator[tuple]:
        """Run `sql` whose `{in}` is `column IN (...)` over `values`, a chunk at a time."""
        for chunk in chunks(list(values)):
            names = {f"v{j}": v for j, v in enumerate(chunk)}
            cond = f"{column} IN ({', '.join(':' + n for n in names)})"
            yield from self._rows(sql.format(**{"in": cond}), **params, **names)

    # -- caches -------------------------------------------------------------------------------------

    def _find_cache(self, host: str, root: str) -> CacheRow | None:
        rows = self.driver.rows(CACHE_SQL + " WHERE host = :host AND root = :root", {"host": host, "root": root})
        return CacheRow(*rows[0]) if rows else None

    def cache_row(self) -> CacheRow | None:
        if self._cache_id is None:
            return None
        rows = self._rows(CACHE_SQL + " WHERE id = :cache")
        return CacheRow(*rows[0]) if rows else None

    def caches(self, host: str | None = None) -> list[CacheRow]:
        """Every cache of the index (of one host), by host and root."""
        where = "" if host is None else " WHERE host = :host"
        return [CacheRow(*r) for r in self._rows(CACHE_SQL + where + " ORDER BY host, root", host=host)]

    def scanned(self) -> bool:
        c = self.cache_row()
        return c is not None and c.last_scan is not None

    # -- totals -------------------------------------------------------------------------------------

    def totals(self) -> Totals:
        by_kind = {k.value: Usage() for k in Kind}
        oldest = newest = None
        # (each query reads one index, not the rows: ix_entries_usage covers the first)
        mtime = _known("mtime", MAX_TIME)
        for kind, n, files, size, lo, hi in self._rows(
            f"SELECT kind, COUNT(*), {_sum(_known('files', MAX_FILES))}, {_sum(_known('bytes', MAX_BYTES))}, "
            f"MIN({mtime}), MAX({mtime}) "
            "FROM entries WHERE cache_id = :cache GROUP BY kind"
        ):
            by_kind[kind] = Usage(whole(n), whole(files), whole(size))
            lo, hi = moment(lo, math.nan), moment(hi, math.nan)
            if math.isfinite(lo):
                oldest = lo if oldest is None else min(oldest, lo)
            if math.isfinite(hi):
                newest = hi if newest is None else max(newest, hi)
        pending = int(self._scalar("SELECT COUNT(*) FROM entries WHERE cache_id = :cache AND parse_state > 0") or 0)
        # (SQLite, with no statistics, took the (cache_id, parse_state) index and read every row
        # of the cache: 45 ms of `stats`'s 200 at a million files. `+cache_id` has it read the
        # partial index of corrupt entries, a few rows; PostgreSQL chooses by its statistics.)
        cache_id = "+cache_id" if self.dialect == "sqlite" else "cache_id"
        corrupt = int(
            self._scalar(f"SELECT COUNT(*) FROM entries WHERE {cache_id} = :cache AND corrupt IS NOT NULL") or 0
        )
        pins = int(self._scalar("SELECT COUNT(*) FROM pins WHERE cache_id = :cache") or 0)
        c = self.cache_row()
        return Totals(
            self.root,
            by_kind,
            corrupt,
            pending,
            pins,
            oldest,
            newest,
            c.last_scan if c else None,
            c.last_eviction if c else None,
        )

    def idle_usage(self, older_than: float, now: float | None = None) -> Usage:
        """Entries not accessed for `older_than` seconds."""
        cutoff = (time.time() if now is None else now) - older_than
        n, files, size = self._rows(
            f"SELECT COUNT(*), {_sum(_known('files', MAX_FILES))}, {_sum(_known('bytes', MAX_BYTES))} "
            "FROM entries WHERE cache_id = :cache AND last_access <= :cutoff",
            cutoff=cutoff,
        )[0]
        return Usage(int(n or 0), whole(files), whole(size))

    # -- entries ------------------------------------------------------------------------------------

    def entries(self, f: Filters = Filters(), now: float | None = None) -> list[Entry]:
        """Entries of the cache, filtered and sorted (largest first, by default)."""
        where: list[str] = ["e.cache_id = :cache"]
        params: dict[str, Any] = {}
        if f.kind:
            where.append("e.kind = :kind")
            params["kind"] = f.kind
        elif not f.locks:
            where.append(f"e.kind <> '{Kind.LOCK.value}'")
        if f.older_than is not None:
            where.append("e.last_access <= :cutoff")
            params["cutoff"] = (time.time() if now is None else now) - f.older_than
        if f.larger_than is not None:
            where.append("e.bytes > :larger")
            params["larger"] = f.larger_than
        if f.corrupt:
            where.append("e.corrupt IS NOT NULL")
        order = {
            "size": "e.bytes DESC",
            "age": "e.last_access ASC",
            "cost": "CASE WHEN e.compile_seconds IS NULL THEN 1 ELSE 0 END, e.compile_seconds DESC",
            "name": "e.key",
        }[f.sort]
        sql = f"SELECT {ENTRY_COLUMNS} FROM entries e WHERE {' AND '.join(where)}"
        pins = self.pin_map()
        if f.graphs is not None:
            rows: list[tuple] = []
            for cond in ("e.graph_key", "e.ref"):
                rows.extend(self._chunked(sql + " AND {in}", cond, sorted(f.graphs), **params))
            out = list({r[0]: _entry(r, pins) for r in rows}.values())
            out.sort(key=SORT_KEYS[f.sort])
        else:
            limit = f" LIMIT {int(f.limit)}" if f.limit is not None and not f.pinned else ""
            out = [_entry(r, pins) for r in self._rows(f"{sql} ORDER BY {order}, e.key{limit}", **params)]
        if f.pinned:
            out = [e for e in out if e.pinned]
        return out[: f.limit] if f.limit is not None else out

    def entry_by_key(self, key: str) -> Entry | None:
        rows = self._rows(f"SELECT {ENTRY_COLUMNS} FROM entries e WHERE e.cache_id = :cache AND e.key = :key", key=key)
        return _entry(rows[0], self.pin_map()) if rows else None

    def references(self, e: Entry) -> list[dict[str, Any]]:
        """What an entry needs: (kind, name, present in the index)."""
        out = []
        for kind, ref in self._rows(
            "SELECT kind, ref FROM entry_refs WHERE entry_id = :id ORDER BY kind, ref", id=e.id
        ):
            present = self._rows(
                "SELECT 1 FROM entries WHERE cache_id = :cache AND kind = :kind AND "
                "(ref = :ref OR alias = :ref) LIMIT 1",
                kind=kind,
                ref=ref,
            )
            out.append({"kind": kind, "ref": ref, "present": bool(present)})
        return out

    def referenced_by(self, e: Entry) -> list[Entry]:
        """The entries that need this one, by key."""
        names = [n for n in (e.ref, e.alias) if n]
        if not names:
            return []
        rows = self._chunked(
            f"SELECT {ENTRY_COLUMNS} FROM entries e JOIN entry_refs r ON r.entry_id = e.id "
            "WHERE e.cache_id = :cache AND r.kind = :kind AND {in}",
            "r.ref",
            names,
            kind=e.kind,
        )
        return sorted({r[1]: _entry(r) for r in rows}.values(), key=lambda x: x.key)

    def component_count(self, e: Entry) -> int:
        return int(self._scalar("SELECT COUNT(*) FROM entry_components WHERE entry_id = :id", id=e.id) or 0)

    # -- keys ---------------------------------------------------------------------------------------

    def resolve(self, spec: str) -> Match:
        """What KEY names, in any form a command prints: an entry key, a graph key (or any ref),
        a short key, a unique prefix of any of these, or explain's 'graph/file' form.
        Ambiguous: AmbiguousKey (exit 2). Unknown: NotFound (exit 3)."""
        spec = spec.strip()
        if not spec or "\x00" in spec:
            raise UsageError("give a key (as ls prints it)")
        pins = self.pin_map()
        select = f"SELECT {ENTRY_COLUMNS} FROM entries e WHERE e.cache_id = :cache AND "
        rows = self._rows(select + "(e.key = :s OR e.ref = :s OR e.graph_key = :s)", s=spec)
        exact = [_entry(r, pins) for r in rows]
        if any(e.key == spec for e in exact):
            return Match(spec, tuple(e for e in exact if e.key == spec))
        if exact:
            return Match(spec, _newest(exact), spec)
        if len(spec) < PREFIX_MIN:
            raise NotFound(
                f"no entry {spec!r} in the index of {self.root} (a prefix needs at least "
                f"{PREFIX_MIN} characters; see: cachemgr ls)"
            )
        head, slash, tail = spec.partition("/")
        limit = f" LIMIT {CANDIDATES * 20}"
        found: dict[int, Entry] = {}
        by_key = self._rows(select + "substr(e.key, 1, :n) = :s" + limit, s=spec, n=len(spec))
        found.update((r[0], _entry(r, pins)) for r in by_key)
        by_ref = self._rows(select + "substr(e.ref, 1, :n) = :h" + limit, h=head, n=len(head))
        named = [_entry(r, pins) for r in by_ref]
        if slash:  # 'REF/NAME': entries of a ref that start with NAME (explain's 'graph/file' form too)
            named = [e for e in named if e.name.startswith(tail)]
        found.update((e.id, e) for e in named)
        if not found:
            raise NotFound(f"no entry {spec!r} in the index of {self.root} (see: cachemgr ls)")
        hits = list(found.values())
        refs = {e.ref for e in hits}
        if len(refs) == 1 and None not in refs:
            # Every entry of one ref, named by a prefix of the ref (a short key of a graph) or by a
            # path prefix of several entries (a graph's folder): the ref itself. A prefix of one
            # entry's path, or 'REF/NAME', names that entry.
            (ref,) = refs
            every = [_entry(r, pins) for r in self._rows(select + "e.ref = :r", r=ref)]
            if {e.id for e in every} == found.keys() and ((named and not tail) or len(every) > 1):
                return Match(spec, _newest(every), ref)
        if len(hits) == 1:
            return Match(spec, tuple(hits))
        groups: dict[Any, Entry] = {}
        for e in sorted(hits, key=lambda e: e.key):
            groups.setdefault(e.ref if (e.ref and not slash) else e.key, e)
        candidates = list(groups.values())[:CANDIDATES]
        raise AmbiguousKey(
            spec,
            candidates,
            len(groups) > CANDIDATES or len(by_key) >= CANDIDATES * 20 or len(by_ref) >= CANDIDATES * 20,
            self.short_keys(candidates),
        )

    def short_keys(self, entries: Iterable[Entry | GraphEntry]) -> dict[str, str]:
        """key -> short key of each entry (see the module's docstring)."""
        entries = list(entries)
        if not entries:
            return {}
        names = self._names()
        shared = {
            text(ref)
            for (ref,) in self._rows(
                "SELECT ref FROM entries WHERE cache_id = :cache AND ref IS NOT NULL GROUP BY ref HAVING COUNT(*) > 1"
            )
        }
        wanted = sorted({e.ref for e in entries if e.ref and e.ref in shared})
        siblings: dict[str, list[str]] = {}
        for ref, key in self._chunked("SELECT ref, key FROM entries WHERE cache_id = :cache AND {in}", "ref", wanted):
            siblings.setdefault(text(ref), []).append(text(key))
        out = {}
        for e in entries:
            if not e.ref:
                out[e.key] = e.key
                continue
            short = unique_prefix(e.ref, names)
            if e.ref in siblings:
                others = sorted(entry_name(k, e.ref) for k in siblings[e.ref])
                short += "/" + unique_prefix(entry_name(e.key, e.ref), others)
            out[e.key] = short
        return out

    def short_graph_keys(self, graph_keys: Iterable[str]) -> dict[str, str]:
        """graph key (or any ref) -> its short form."""
        names = self._names()
        return {g: unique_prefix(text(g), names) for g in graph_keys}

    def _names(self) -> list[str]:
        """Every ref (an entry without one: its key) of the cache, sorted: what short keys tell apart."""
        return sorted(
            {text(n) for (n,) in self._rows("SELECT DISTINCT COALESCE(ref, key) FROM entries WHERE cache_id = :cache")}
        )

    # -- pins ---------------------------------------------------------------------------------------

    def pin_map(self) -> dict[str, str | None]:
        """Pinned keys (entry keys, graph keys or refs) -> the reason given."""
        if self._cache_id is None:
            return {}
        return {k: r for k, r in self._rows("SELECT key, reason FROM pins WHERE cache_id = :cache")}

    def pins(self) -> list[Pin]:
        out = []
        for key, reason, created in self._rows(
            "SELECT key, reason, created FROM pins WHERE cache_id = :cache ORDER BY created, key"
        ):
            n = self._scalar(
                "SELECT COUNT(*) FROM entries WHERE cache_id = :cache AND (key = :k OR graph_key = :k OR ref = :k)",
                k=key,
            )
            out.append(Pin(key, reason, moment(created), int(n or 0)))
        return out

    def add_pin(self, key: str, reason: str | None, now: float | None = None) -> Pin | None:
        """Pin `key`. Returns the pin it had before (None: a new pin). A reason given replaces the old
        one; none given keeps it."""
        rows = self._rows("SELECT key, reason, created FROM pins WHERE cache_id = :cache AND key = :k", k=key)
        if rows:
            if reason is not None:
                self.driver.write(
                    "UPDATE pins SET reason = :r WHERE cache_id = :cache AND key = :k",
                    {"cache": self.cache_id, "k": key, "r": reason},
                )
            return Pin(*rows[0])
        self.driver.write(
            "INSERT INTO pins (cache_id, key, reason, created) VALUES (:cache, :k, :r, :t)",
            {"cache": self.cache_id, "k": key, "r": reason, "t": time.time() if now is None else now},
        )
        return None

    def remove_pin(self, key: str) -> bool:
        return (
            self.driver.write(
                "DELETE FROM pins WHERE cache_id = :cache AND key = :k", {"cache": self.cache_id, "k": key}
            )
            > 0
        )

    # -- shapes and models --------------------------------------------------------------------------

    def each_shape(self, model: str | None = None) -> Iterator[dict[str, Any]]:
        """Recorded input signatures (cachemgr.record), per model in first-seen order, as stored
        (spec and options JSON text): streamed, SHAPES_STREAM rows at a time, however many there are."""
        where = "" if model is None else " WHERE model = :m"
        cols = ("model", "signature_hash", "signature", "spec", "options", "host", "count", "first_seen", "last_seen")
        rows = self.driver.each(
            f"SELECT {', '.join(cols)} FROM shapes{where} ORDER BY model, first_seen, id", {"m": model}, SHAPES_STREAM
        )
        return (dict(zip(cols, r, strict=True)) for r in rows)

    def models(self) -> list[str]:
        return [m for (m,) in self.driver.rows("SELECT DISTINCT model FROM shapes ORDER BY model", {})]

    def no_model(self, model: str, instead: str | None = None) -> NotFound:
        """The error for a model with no recorded shapes, naming what is recorded instead."""
        known = len(self.models())
        return NotFound(
            f"no recorded shapes for model {model!r}"
            + (
                f" ({known} other models are recorded: cachemgr shapes lists them)"
                if known
                else " (the shapes table is empty: record the model with cachemgr.record"
                + (f", or use {instead})" if instead else ")")
            )
        )

    def model_graphs(self, model: str, instead: str | None = None) -> set[str]:
        """Graph keys of a model, through the input signatures cachemgr.record wrote to `shapes`;
        `instead`: the option of the asking command that names graphs without a model ('--graph KEY').

        A recorded signature names the model's call inputs ('(f32[8,16])'); an fxgraph entry's
        signature names the graph's inputs, parameters included ('f32[32, 16](16, 1)cpu; f32[8, 16]...').
        An entry belongs to the model when it holds every recorded tensor (dtype[shape]) of one
        signature. A graph that went dynamic (symbolic dims) no longer matches concrete shapes.
        """
        signatures = [s["signature"] for s in self.each_shape(model)]
        if not signatures:
            raise self.no_model(model, instead)
        found = _graphs_with(
            signatures,
            self._rows(
                "SELECT graph_key, signature FROM entries WHERE cache_id = :cache AND kind = 'fxgraph' "
                "AND graph_key IS NOT NULL"
            ),
        )
        if not found:
            raise NotFound(
                f"model {model!r} has {len(signatures)} recorded signatures, but no fxgraph entry "
                "has those inputs (run: cachemgr scan)"
            )
        return found

    def model_usage(self) -> list[ModelUsage]:
        """Per recorded model: its graphs, and the entries and bytes they hold (an entry several
        models need counts in each)."""
        fx = self._rows(
            "SELECT id, graph_key, signature, bytes, COALESCE(hit_count, 0), compile_seconds, "
            "last_access, ref FROM entries WHERE cache_id = :cache AND kind = 'fxgraph' "
            "AND graph_key IS NOT NULL"
        )
        # fxgraph entry id -> {entry id: bytes} of what it needs, and of the AOT entries that name it
        deps: dict[int, dict[int, int]] = {}
        for fid, did, size in self._rows(
            "SELECT v.id, d.id, d.bytes FROM entries v JOIN entry_refs r ON r.entry_id = v.id "
            "JOIN entries d ON d.cache_id = v.cache_id AND d.kind = r.kind AND (d.ref = r.ref OR d.alias = r.ref) "
            "WHERE v.cache_id = :cache AND v.kind = 'fxgraph' "
            "UNION SELECT v.id, a.id, a.bytes FROM entries a JOIN entry_refs r ON r.entry_id = a.id "
            "AND r.kind = 'fxgraph' JOIN entries v ON v.cache_id = a.cache_id AND v.ref = r.ref "
            "WHERE a.cache_id = :cache AND a.kind = 'aotautograd'"
        ):
            deps.setdefault(fid, {})[did] = whole(size)
        by_model: dict[str, list[str]] = {}
        for s in self.each_shape():
            by_model.setdefault(s["model"], []).append(s["signature"])
        out = []
        for model, signatures in by_model.items():
            graphs = _graphs_with(signatures, [(r[1], r[2]) for r in fx])
            rows = [r for r in fx if r[1] in graphs]
            held = {r[0]: whole(r[3]) for r in rows}
            for r in rows:
                held.update(deps.get(r[0], {}))
            out.append(
                ModelUsage(
                    model,
                    len(signatures),
                    len(graphs),
                    len(held),
                    sum(held.values()),
                    sum(whole(r[4]) for r in rows),
                    sum(moment(r[5]) for r in rows),
                    max((r[6] for r in rows), default=None),
                )
            )
        return out

    # -- activity: compiles, loads, hits (cachemgr.explain.activity counts them) --------------------

    def last_event_id(self) -> int:
        return int(self._scalar("SELECT MAX(id) FROM events WHERE cache_id = :cache") or 0)

    def compile_events(
        self, since: float | None = None, after_id: int = 0, upto_id: int | None = None
    ) -> list[CompileEvent]:
        """New fxgraph entries (events since `since`, or with ids in (after_id, upto_id]), oldest
        first. An entry is *loaded*, not compiled, when a load said so (a 'loaded' event) or when
        its bytes were known to the index before it appeared: torch names an entry file by the
        hash of its bytes, and each compile's bytes differ (they hold its own compile time), so
        known bytes are a copy (an import, a remote fill, a restored cache)."""
        rows = self._rows(
            "SELECT v.id, v.ts, v.entry_key, v.graph_key, v.seconds, v.kind, e.id, "
            "CASE WHEN EXISTS (SELECT 1 FROM parsed_content pc WHERE pc.name = e.content AND pc.bytes = e.bytes "
            "AND pc.parsed_at < e.first_seen) THEN 1 ELSE 0 END "
            "FROM events v LEFT JOIN entries e ON e.cache_id = v.cache_id AND e.key = v.entry_key "
            f"WHERE v.cache_id = :cache AND v.kind IN ('{Event.NEW.value}', '{Event.LOADED.value}') "
            "AND v.entry_kind = 'fxgraph' AND v.ts >= :since AND v.id > :after AND v.id <= :upto "
            + ("" if since is None else f"AND v.ts < {MAX_TIME!r} ")  # (an unknown time is in no window)
            + "ORDER BY v.ts, v.id",
            since=-1.0 if since is None else since,
            after=after_id,
            upto=upto_id if upto_id is not None else 1 << 62,
        )
        return [
            CompileEvent(
                int(i),
                moment(ts),
                str(text(key)),
                words(gk),
                None if s is None else moment(s),
                kind == Event.LOADED or bool(copy),
                eid,
            )
            for i, ts, key, gk, s, kind, eid, copy in rows
        ]

    def event_counts(self, since: float | None = None, after_id: int = 0, upto_id: int | None = None) -> dict[str, int]:
        """Events by kind (hits: reads of fxgraph entries; evictions)."""
        rows = self._rows(
            "SELECT kind, COUNT(*) FROM events WHERE cache_id = :cache AND ts >= :since AND id > :after "
            "AND id <= :upto AND (kind <> :hit OR entry_kind = 'fxgraph') "
            + ("" if since is None else f"AND ts < {MAX_TIME!r} ")  # (an unknown time is in no window)
            + "GROUP BY kind",
            since=-1.0 if since is None else since,
            after=after_id,
            upto=upto_id if upto_id is not None else 1 << 62,
            hit=Event.HIT.value,
        )
        return {k: int(n) for k, n in rows}

    def mark_loaded(self, keys: Iterable[str]) -> int:
        """Say that these entries were loaded (`cachemgr import`), not compiled: their 'new'
        events become 'loaded' ones."""
        n = 0
        for chunk in chunks(sorted(set(keys))):
            names = {f"v{j}": k for j, k in enumerate(chunk)}
            n += self.driver.write(
                f"UPDATE events SET kind = '{Event.LOADED.value}' WHERE cache_id = :cache AND kind = "
                f"'{Event.NEW.value}' AND entry_key IN ({', '.join(':' + k for k in names)})",
                {"cache": self.cache_id, **names},
            )
        return n

    def hit_graphs(self, since: float) -> set[str]:
        """Graph keys read (hit) since `since`."""
        return {
            g
            for (g,) in self._rows(
                "SELECT DISTINCT graph_key FROM events WHERE cache_id = :cache AND "
                "kind = :hit AND ts >= :since AND graph_key IS NOT NULL",
                hit=Event.HIT.value,
                since=since,
            )
        }

    def push_candidates(self) -> tuple[list[tuple], dict[int, list[str]]]:
        """The readable fxgraph and AOT entries, as (id, key, kind, ref, mtime, compile_seconds,
        torch_version, signature_hash), and each AOT entry's graph keys: what `remote push` publishes."""
        rows = self._rows(
            "SELECT id, key, kind, ref, mtime, compile_seconds, torch_version, signature_hash FROM entries "
            "WHERE cache_id = :cache AND kind IN (:fx, :aot) AND corrupt IS NULL",
            fx=Kind.FXGRAPH.value,
            aot=Kind.AOTAUTOGRAD.value,
        )
        edges: dict[int, list[str]] = {}
        for eid, ref in self._rows(
            "SELECT r.entry_id, r.ref FROM entry_refs r JOIN entries e ON e.id = r.entry_id "
            "WHERE e.cache_id = :cache AND e.kind = :aot AND r.kind = :fx",
            fx=Kind.FXGRAPH.value,
            aot=Kind.AOTAUTOGRAD.value,
        ):
            edges.setdefault(eid, []).append(ref)
        return rows, edges

    POLICY_COLUMNS = (
        "id, key, kind, ref, alias, bytes, files, mtime, last_access, compile_seconds, graph_key, "
        "torch_version, system_hash, corrupt, hit_count, torch_version_hash, parse_state"
    )

    def policy_rows(self) -> Iterator[list[tuple]]:
        """Every entry of the cache as eviction plans over it (the POLICY_COLUMNS, by id), a batch
        of rows at a time (its reader takes them column by column): streamed, to be read before
        the next query."""
        return self.driver.batches(
            f"SELECT {self.POLICY_COLUMNS} FROM entries WHERE cache_id = :cache ORDER BY id", {"cache": self._cache_id}
        )

    def policy_refs(self, autotune: bool) -> Iterator[tuple[int, str, str]]:
        """(entry id, kind, ref) of every reference the autotune entries (or all the others) make,
        by entry id: streamed, to be read before the next query."""
        return self.driver.each(
            "SELECT r.entry_id, r.kind, r.ref FROM entry_refs r JOIN entries e ON e.id = r.entry_id "
            f"WHERE e.cache_id = :cache AND e.kind {'=' if autotune else '!='} 'autotune' ORDER BY r.entry_id",
            {"cache": self._cache_id},
        )

    def fingerprint_names(self) -> dict[str, str]:
        """torch_version hash -> the torch build it names, as processes running it reported."""
        return {
            str(text(h)): str(text(n))
            for h, n in self._rows("SELECT hash, name FROM fingerprints WHERE kind = 'torch' ORDER BY last_seen")
        }

    # -- explain: hash components -------------------------------------------------------------------

    def graph_entries(self) -> list[GraphEntry]:
        """Every fxgraph entry of the cache that parsed cleanly, oldest first, with its sets."""
        sets: dict[int, dict[str, int]] = {}
        for eid, part, set_id in self._rows(
            "SELECT s.entry_id, s.part, s.set_id FROM entry_component_sets s JOIN entries e ON e.id = s.entry_id "
            "WHERE e.cache_id = :cache AND e.kind = 'fxgraph'"
        ):
            if type(set_id) is int:  # (a hand edit's text or BLOB names no set: the part is unrecorded)
                sets.setdefault(eid, {})[str(text(part))] = set_id
        rows = self._rows(
            "SELECT e.id, e.key, e.ref, e.graph_key, e.mtime, e.guards, e.unrecorded, "
            "COALESCE(e.torch_version, (SELECT f.name FROM fingerprints f WHERE f.kind = 'torch' AND "
            "f.hash = e.torch_version_hash ORDER BY f.last_seen DESC LIMIT 1)) "
            "FROM entries e WHERE e.cache_id = :cache AND e.kind = 'fxgraph' AND e.corrupt IS NULL "
            "AND e.parse_state = 0 ORDER BY e.mtime, e.id"
        )
        return [
            GraphEntry(
                int(i),
                str(text(k)),
                words(r),
                words(g),
                moment(m),
                words(gu),
                words(un),
                words(tv),
                sets.get(int(i), {}),
            )
            for i, k, r, g, m, gu, un, tv in rows
        ]

    def unread_graphs(self) -> list[tuple[str, str | None, str | None]]:
        """(key, graph key, why it does not read) of each fxgraph entry of the cache that did
        not parse, or (why None) is not parsed yet: what graph_entries leaves out."""
        return [
            (str(text(k)), text(g), words(c))
            for k, g, c in self._rows(
                "SELECT key, graph_key, corrupt FROM entries WHERE cache_id = :cache AND kind = 'fxgraph' "
                "AND (corrupt IS NOT NULL OR parse_state <> 0) ORDER BY mtime, id"
            )
        ]

    def component_sets(self, set_ids: Iterable[int], values: bool = True) -> dict[int, dict[str, Component]]:
        """set id -> {component name: (hash, value)}; without `values` the value is None (the
        graph code is one long value)."""
        out: dict[int, dict[str, Component]] = {}
        column = "value" if values else "NULL"
        for set_id, name, h, value in self._chunked(
            f"SELECT set_id, name, hash, {column} FROM component_set_items WHERE {{in}}",
            "set_id",
            sorted({i for i in set_ids if type(i) is int}),
        ):
            # (as text: a BLOB or a number where a hand edit put one)
            out.setdefault(set_id, {})[str(text(name))] = (str(text(h)), words(value))
        return out

    # -- fleet: every cache of the index ------------------------------------------------------------

    def fleet_hosts(self) -> list[tuple[str, int, int, int, int, int, float | None]]:
        """(host, caches, entries, bytes, entries of unknown size, hit count, last scan) of every host."""
        return [
            (h, int(c), int(n), int(b), int(unknown), int(hits), known_time(last))
            for h, c, n, b, unknown, hits, last in self._rows(
                f"SELECT c.host, COUNT(DISTINCT c.id), COUNT(e.id), {_sum(_BYTES)}, COUNT(e.id) - COUNT({_BYTES}), "
                f"{_sum(_known('e.hit_count', MAX_HITS))}, MAX({_known('c.last_scan', MAX_TIME)}) "
                "FROM caches c LEFT JOIN entries e ON e.cache_id = c.id GROUP BY c.host ORDER BY c.host"
            )
        ]

    def fleet_hits(self, since: float) -> dict[str, int]:
        """host -> fxgraph hits at or after `since` (an unknown time is in no window)."""
        return {
            h: int(n)
            for h, n in self._rows(
                "SELECT c.host, COUNT(*) FROM events v JOIN caches c ON c.id = v.cache_id WHERE v.kind = :hit "
                f"AND v.entry_kind = 'fxgraph' AND v.ts >= :since AND v.ts < {MAX_TIME!r} GROUP BY c.host",
                hit=Event.HIT.value,
                since=since,
            )
        }

    def host_torch_version(self, host: str) -> str | None:
        """The torch version of a host's newest fxgraph entry (one of unknown mtime is the oldest)."""
        return self._scalar(
            "SELECT e.torch_version FROM entries e JOIN caches c ON c.id = e.cache_id WHERE c.host = :host "
            "AND e.kind = 'fxgraph' AND e.torch_version IS NOT NULL "
            f"ORDER BY COALESCE({_known('e.mtime', MAX_TIME)}, -1) DESC LIMIT 1",
            host=host,
        )

    def shared_graphs(self, min_hosts: int, limit: int) -> list[dict[str, Any]]:
        """Graphs that `min_hosts` or more hosts hold, most hosts first; bytes of their known sizes."""
        rows = self._rows(
            f"SELECT e.graph_key, COUNT(DISTINCT c.host), COUNT(*), {_sum(_BYTES)}, COALESCE(MAX({_BYTES}), 0), "
            f"MAX({_known('e.compile_seconds', MAX_SECONDS)}), MAX(e.torch_version) "
            "FROM entries e JOIN caches c ON c.id = e.cache_id "
            "WHERE e.kind = 'fxgraph' AND e.graph_key IS NOT NULL GROUP BY e.graph_key "
            "HAVING COUNT(DISTINCT c.host) >= :min_hosts ORDER BY 2 DESC, 4 DESC, 1",
            min_hosts=min_hosts,
        )
        return [
            {
                "graph_key": g,
                "hosts": int(nh),
                "entries": int(n),
                "bytes": int(size),
                "redundant_bytes": int(size) - int(biggest),
                "compile_seconds": None if cost is None else round(float(cost), 3),
                "torch_version": tv,
            }
            for g, nh, n, size, biggest, cost, tv in rows[:limit]
        ]

    def torch_versions(self) -> list[tuple[str, int, int, int]]:
        """(version, fxgraph entries, their known bytes, hosts) of every torch version in the index."""
        rows = self._rows(
            f"SELECT e.torch_version, COUNT(*), {_sum(_BYTES)}, COUNT(DISTINCT c.host) FROM entries e "
            "JOIN caches c ON c.id = e.cache_id WHERE e.kind = 'fxgraph' AND e.torch_version IS NOT NULL "
            "GROUP BY e.torch_version"
        )
        return sorted(((v, int(n), int(size), int(nh)) for v, n, size, nh in rows), key=lambda r: str(r[0]))

    def version_dependents(self) -> list[tuple[str, int, int]]:
        """(torch version, entry id, bytes) of entries without a version of their own (kernels, modules,
        AOT entries) that belong to a version through the fxgraph entries that name them or that
        they name. `kind || ''` keeps SQLite's planner (no ANALYZE statistics) off the
        (cache_id, kind) index and on (cache_id, ref|alias): without it this takes minutes on
        40,000 entries instead of a second."""
        return [
            (v, int(i), whole(b))
            for v, i, b in self._rows(
                "SELECT v.torch_version, d.id, d.bytes FROM entries v JOIN entry_refs r ON r.entry_id = v.id "
                "JOIN entries d ON d.cache_id = v.cache_id AND d.ref = r.ref AND d.kind || '' = r.kind "
                "WHERE v.torch_version IS NOT NULL "
                "UNION SELECT v.torch_version, d.id, d.bytes FROM entries v JOIN entry_refs r ON r.entry_id = v.id "
                "JOIN entries d ON d.cache_id = v.cache_id AND d.alias = r.ref AND d.kind || '' = r.kind "
                "WHERE v.torch_version IS NOT NULL "
                "UNION SELECT v.torch_version, a.id, a.bytes FROM entries a "
                "JOIN entry_refs r ON r.entry_id = a.id AND r.kind = 'fxgraph' "
                "JOIN entries v ON v.cache_id = a.cache_id AND v.ref = r.ref AND v.kind || '' = 'fxgraph' "
                "WHERE a.kind = 'aotautograd' AND v.torch_version IS NOT NULL"
            )
        ]

    # -- the cache check (cachemgr.check): learned fingerprints, the fleet's fragmentation ---------

    def record_fingerprint(self, kind: str, hash_: str, name: str, now: float | None = None) -> None:
        """Learn what a `torch_version` (kind 'torch') or `system_info` (kind 'system') hash names
        on this host, as a process running that torch reported it."""
        now = time.time() if now is None else now
        self.driver.write(
            "INSERT INTO fingerprints (kind, hash, host, name, first_seen, last_seen) "
            "VALUES (:kind, :hash, :host, :name, :now, :now) "
            "ON CONFLICT (kind, hash, host) DO UPDATE SET name = :name, last_seen = :now",
            {"kind": kind[:16], "hash": hash_[:64], "host": self.host[:255], "name": name[:255], "now": now},
        )

    def fingerprints(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Every learned fingerprint of every host, newest first."""
        cols = ("kind", "hash", "host", "name", "first_seen", "last_seen")
        where = "" if kind is None else " WHERE kind = :kind"
        return [
            dict(zip(cols, r, strict=True))
            for r in self.driver.rows(
                f"SELECT {', '.join(cols)} FROM fingerprints{where} ORDER BY last_seen DESC, kind, hash", {"kind": kind}
            )
        ]

    def fleet_graph_sets(self) -> list[tuple[str, int, str | None, str, int]]:
        """(host, entry id, graph key, part, component set id) of every parsed fxgraph entry of
        every cache in the index: what the fragmentation report groups by graph code."""
        return [
            (h, int(i), g, p, whole(s))
            for h, i, g, p, s in self.driver.rows(
                "SELECT c.host, e.id, e.graph_key, s.part, s.set_id FROM entries e "
                "JOIN caches c ON c.id = e.cache_id JOIN entry_component_sets s ON s.entry_id = e.id "
                "WHERE e.kind = 'fxgraph' AND e.corrupt IS NULL AND e.parse_state = 0 ORDER BY c.host, e.id",
                {},
            )
        ]


SORT_KEYS = {
    "size": lambda e: (-e.bytes, e.key),
    "age": lambda e: (e.last_access, e.key),
    "cost": lambda e: (e.compile_seconds is None, -(e.compile_seconds or 0.0), e.key),
    "name": lambda e: e.key,
}


def _newest(entries: Iterable[Entry]) -> tuple[Entry, ...]:
    return tuple(sorted(entries, key=lambda e: (-e.mtime, e.key)))


def unique_prefix(name: str, names: Sequence[str], minimum: int = SHORT_MIN) -> str:
    """The shortest prefix of `name` (at least `minimum` characters) that no other of the sorted
    `names` starts with; the whole name when it is itself a prefix of another. It never ends
    inside a %XX escape (layout.key_of: every '%' of a key begins one)."""
    i = bisect.bisect_left(names, name)
    common = 0
    for j in (i - 1, i, i + 1):
        if 0 <= j < len(names) and names[j] != name:
            other = names[j]
            n = 0
            while n < min(len(name), len(other)) and name[n] == other[n]:
                n += 1
            common = max(common, n)
    end = max(minimum, common + 1)
    escape = name.rfind("%", 0, end)
    return name[: max(end, escape + 3) if escape >= 0 else end]


def _graphs_with(signatures: Iterable[str | None], entries: Iterable[tuple[str | None, str | None]]) -> set[str]:
    """Graph keys of the entries whose signature holds every tensor of one recorded signature."""
    from cachemgr.signatures import call_matches, tensors_of

    tensor_sets = [s for sig in signatures if (s := tensors_of(sig))]
    found = set()
    for gk, sig in entries:
        have = tensors_of(sig)
        if gk and any(call_matches(ts, have) for ts in tensor_sets):
            found.add(gk)
    return found


# -- the quick rescan of an unchanged tree ----------------------------------------------------------

RELISTED_MOST = 64  # directories without entries read again that the quick rescan settles itself


def rescan_unchanged(path: str, head: str, host: str, root: str) -> ScanResult | None:
    """The rescan of a tree in which no directory changed since the last scan, over stdlib sqlite3:
    its result (every entry unchanged), or None when anything changed (then `scan.reconcile` does the work).

    Importing SQLAlchemy costs about as much as `find` over a 100,000-file cache; a tree whose
    directories all kept their mtimes (`layout.walk_dirs` reads none of them) needs none of it.
    """
    from cachemgr.layout import RACY, walk_dirs
    from cachemgr.vocab import READER

    conn = open_sqlite(path, write=True)
    if conn is None:
        return None
    try:
        if conn.execute("SELECT version_num FROM alembic_version").fetchone() != (head,):
            return None
        cache = conn.execute(
            "SELECT id, last_scan, reader FROM caches WHERE host = ? AND root = ?", (host, root)
        ).fetchone()
        if cache is None or cache[1] is None or cache[2] != READER:
            return None  # never scanned, or read by other readers: a real scan reads the entries again
        cache_id = cache[0]
        waiting = conn.execute("SELECT 1 FROM entries WHERE cache_id = ? AND parse_state <> 0 LIMIT 1", (cache_id,))
        if waiting.fetchone():
            return None  # entries wait to be parsed: a real scan reads them
        stored = dict(conn.execute("SELECT path, mtime_ns FROM dirs WHERE cache_id = ?", (cache_id,)))
        walked = walk_dirs(root, "", stored) if stored else None
        if walked is None or walked.entries or walked.unreadable or walked.mtimes.keys() != stored.keys():
            return None
        if walked.lost:  # a folder lost a subfolder during the walk: a real scan records it RACY
            return None
        # Directories read again that hold no entry, then or now, and the same subdirectories (the
        # same set of paths): the root, whose mtime a first scan's trash folder moved just before
        # its walk (recorded RACY), or a folder a compile made and emptied. Their new mtimes are
        # kept; anything more is `scan.reconcile`'s.
        # A mount point met (recorded RACY, not listed) is one of them.
        relisted = [(m, d) for d, m in walked.mtimes.items() if m == RACY or m != stored[d]]
        mount_points = sum(1 for d in walked.mounted if d in walked.mtimes)
        if len(relisted) != walked.listed + mount_points or len(relisted) > RELISTED_MOST:
            return None
        # Checked and written in one write transaction: a scan beside this one that commits an
        # entry of such a directory commits before (seen here) or after (its mtime then wins).
        conn.execute("BEGIN IMMEDIATE")
        for _, d in relisted:
            if conn.execute("SELECT 1 FROM entries WHERE cache_id = ? AND dir = ? LIMIT 1", (cache_id, d)).fetchone():
                return None  # (rolled back as the connection closes)
        conn.executemany(f"UPDATE dirs SET mtime_ns = ? WHERE cache_id = {int(cache_id)} AND path = ?", relisted)
        conn.execute("UPDATE caches SET last_scan = ? WHERE id = ?", (time.time(), cache_id))
        conn.execute("COMMIT")
        count = conn.execute("SELECT COUNT(*) FROM entries WHERE cache_id = ?", (cache_id,)).fetchone()[0]
        return ScanResult(root, unchanged=count, mounted=walked.mounted)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


__all__ = [
    "AmbiguousKey",
    "CacheRow",
    "CompileEvent",
    "Entry",
    "Filters",
    "GraphEntry",
    "Match",
    "ModelUsage",
    "Pin",
    "Store",
    "Totals",
    "Usage",
    "open_sqlite",
    "rescan_unchanged",
    "sqlite_path",
    "unique_prefix",
]
