"""SQL over a DB-API connection, the driver's own: stdlib sqlite3, or psycopg's under SQLAlchemy.

Phase two of a scan (cachemgr.index.pending) is written here, not in SQLAlchemy Core, so that
`cachemgr scan` on the embedded SQLite index reads its pending entries without importing
SQLAlchemy (its import and the ORM's: 0.4-0.5 s a run, more than `find` over a 100,000-file
cache); the daemon and a PostgreSQL index run the same SQL on the connection under their engine.
Only two things differ between the two databases here: the parameter mark and how a list of
values is passed (`in_`), and JSON columns (`json_mark`, `from_json`).
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

CHUNK = 500  # values per IN list, rows per statement: well under SQLite's and PostgreSQL's limits


def chunks(items: list[T], n: int = CHUNK) -> Iterator[list[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class Sql:
    """One DB-API connection, used inside whatever transaction its owner holds."""

    def __init__(self, raw: Any, sqlite: bool) -> None:
        self.raw, self.sqlite = raw, sqlite

    @classmethod
    def under(cls, conn: Any) -> Sql:
        """The driver connection under an SQLAlchemy Connection (in its transaction)."""
        return cls(conn.connection.driver_connection, conn.dialect.name == "sqlite")

    def in_(self, column: str) -> str:
        """`column IN <one parameter>`, the parameter made by `values`. On SQLite one JSON text
        read by json_each: one statement whatever the list's length (an IN (?, ?, ...) list is
        compiled anew for each length)."""
        return f"{column} IN (SELECT value FROM json_each(?))" if self.sqlite else f"{column} = ANY(?)"

    def values(self, items: Sequence[Any]) -> Any:
        return json.dumps(list(items)) if self.sqlite else list(items)

    @property
    def json_mark(self) -> str:
        """The parameter mark of a value for a JSON column (given as `json.dumps` text)."""
        return "?" if self.sqlite else "CAST(? AS JSON)"

    @staticmethod
    def from_json(value: Any) -> Any:
        """A JSON column's value as read: SQLite's is text, psycopg's already loaded."""
        return json.loads(value) if isinstance(value, (str, bytes)) else value

    def _sql(self, sql: str) -> str:
        return sql if self.sqlite else sql.replace("?", "%s")  # (no statement here holds a '?' or '%' of its own)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        cur = self.raw.cursor()
        try:
            cur.execute(self._sql(sql), tuple(params))
            return cur.fetchall()
        finally:
            cur.close()

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple:
        (row,) = self.rows(sql, params)
        return row

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute one statement; the number of rows it changed."""
        cur = self.raw.cursor()
        try:
            cur.execute(self._sql(sql), tuple(params))
            return cur.rowcount
        finally:
            cur.close()

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if not rows:
            return
        cur = self.raw.cursor()
        try:
            cur.executemany(self._sql(sql), rows)
        finally:
            cur.close()


class Connections(Protocol):
    """Where phase two gets its connections: one to read with (no transaction held), one to
    write with (a transaction, committed as the block ends)."""

    def reading(self) -> Any: ...

    def writing(self) -> Any: ...


class OverEngine:
    """The connections of an SQLAlchemy engine (cachemgr.index.db.Database)."""

    def __init__(self, db: Any) -> None:
        self.db = db

    @contextmanager
    def reading(self) -> Iterator[Sql]:
        with self.db.engine.connect() as conn:
            yield Sql.under(conn)

    @contextmanager
    def writing(self) -> Iterator[Sql]:
        with self.db.engine.begin() as conn:
            yield Sql.under(conn)


class OverSqlite:
    """One stdlib connection to the embedded index (autocommit: each write block is an immediate
    transaction, so it waits for the write lock at its start, never half way)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn, self.sql = conn, Sql(conn, True)

    @contextmanager
    def reading(self) -> Iterator[Sql]:
        yield self.sql

    @contextmanager
    def writing(self) -> Iterator[Sql]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.sql
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")


def driver_errors(name: str, *also: type[Exception]) -> tuple[type[Exception], ...]:
    """`also`, and the DB-API exception class `name` ('IntegrityError', 'OperationalError') of
    each driver this process has loaded: what this module's SQL raises where SQLAlchemy's would
    raise its own (pass SQLAlchemy's as `also`)."""
    drivers = [sqlite3, sys.modules.get("psycopg")]
    return (*also, *(getattr(d, name) for d in drivers if d is not None))


def connections(db: Any) -> Connections:
    """`db` as phase two uses it: a Database (SQLAlchemy's engine), or Connections already."""
    return db if isinstance(db, (OverEngine, OverSqlite)) else OverEngine(db)
