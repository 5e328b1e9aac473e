"""Engine, pragmas and migrate-at-start for the index database (SQLite or PostgreSQL)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import cast

from sqlalchemy import Engine, create_engine, event, make_url, select, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from cachemgr.config import redact_url
from cachemgr.errors import DatabaseError
from cachemgr.index import schema
from cachemgr.index.models import Cache
from cachemgr.index.revision import HEAD_REVISION


def migrations_dir() -> Path:
    """migrations/ of a checkout, or cachemgr/migrations inside an installed wheel."""
    here = Path(__file__).resolve().parent.parent
    for cand in (here / "migrations", here.parent / "migrations"):
        if (cand / "env.py").is_file():
            return cand
    raise DatabaseError("cannot find cachemgr's migrations (is the package installed completely?)")


def _sqlite_pragmas(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    schema.apply_pragmas(dbapi_conn)


class Database:
    """One index database. `Database(url)` connects and brings the schema to head.

    It never writes where it was not asked to: a SQLite index goes into a folder that exists
    (`create_folder` makes it: for cachemgr's own default state folder), and a database that
    holds tables of something else is refused, not migrated into.
    """

    def __init__(self, url: str, create_folder: bool = False) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        path = ""
        if self.is_sqlite:
            try:  # the file as SQLAlchemy reads the URL (a query, %-escapes): not the URL's text
                path = make_url(url).database or ""
            except (SQLAlchemyError, ValueError):
                path = ""  # (create_engine says what is wrong with it)
            if path and path != ":memory:":
                schema.folder_for(Path(path), create_folder)
        try:
            self.engine: Engine = create_engine(url, pool_pre_ping=not self.is_sqlite)
        except (SQLAlchemyError, ImportError, ValueError) as e:
            raise DatabaseError(f"bad database URL {redact_url(url)}: {e}") from e
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.reserve = Path(f"{path}.reserve") if path and path != ":memory:" else None
        try:
            self.migrate()
        except DatabaseError as e:
            # The disk the index shares with the cache is full: SQLite cannot make its -shm/-wal
            # files, and eviction, which would free the disk, could not even open its index.
            # Give back the space held in reserve for this, and try once more.
            if not (self.reserve and schema.disk_full(e) and schema.release_reserve(self.reserve)):
                raise
            self.engine.dispose()
            self.migrate()
        if self.reserve is not None:
            schema.keep_reserve(self.reserve)

    # -- schema --------------------------------------------------------------------------------

    def current_revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except OperationalError as e:
            if "no such table" in str(e):  # SQLite; PostgreSQL's missing table is a ProgrammingError
                return None  # ("role/database ... does not exist" is a connection failure: not here)
            raise DatabaseError(
                f"cannot open the index {redact_url(self.url)}: {_first_line(e)}{schema.no_room(self.reserve)}"
            ) from e
        except SQLAlchemyError as e:
            if "UndefinedTable" in type(getattr(e, "orig", e)).__name__:
                return None
            raise DatabaseError(f"cannot open the index {redact_url(self.url)}: {_first_line(e)}") from e

    def migrate(self) -> None:
        revision = self.current_revision()
        if revision == HEAD_REVISION:
            return
        if revision is None:
            self._refuse_foreign()
        elif not (isinstance(revision, str) and revision.isascii() and revision.isdigit()):
            # cachemgr numbers its revisions; alembic asserts on some other strings ('', '@')
            raise DatabaseError(
                f"the index {redact_url(self.url)} names schema revision {str(revision)[:40]!r}, which no "
                "cachemgr writes: a damaged index; move it aside and scan again, or use another --db"
            )
        if self.is_sqlite:
            with self.engine.connect() as conn:
                schema.use_wal(cast("sqlite3.Connection", conn.connection.driver_connection))
            if revision is None and self._create_at_head():
                return
        from alembic import command
        from alembic.config import Config
        from alembic.util.exc import CommandError

        cfg = Config()
        cfg.set_main_option("script_location", str(migrations_dir()))
        try:
            with self.engine.begin() as conn:
                if not self.is_sqlite:  # two hosts starting at once migrate one after the other
                    conn.execute(text("SELECT pg_advisory_xact_lock(4242)"))
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        except SQLAlchemyError as e:
            raise DatabaseError(f"cannot migrate the index {redact_url(self.url)}: {_first_line(e)}") from e
        except CommandError as e:  # a revision this cachemgr does not know: a newer one wrote the index
            raise DatabaseError(
                f"the index {redact_url(self.url)} was written by a newer cachemgr (schema revision "
                f"{self.current_revision()}): upgrade cachemgr, or use another --db"
            ) from e

    def _create_at_head(self) -> bool:
        """Make an empty SQLite index's schema at head (schema.HEAD_DDL, made from the models),
        without Alembic: its import and five migrations were a quarter of a first scan's time to
        a usable index. False if the file is not empty: Alembic brings whatever is there to head."""
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # one process creates; the others find it made
                return schema.create_at_head(conn.connection.driver_connection)
        except SQLAlchemyError as e:
            raise DatabaseError(f"cannot create the index {redact_url(self.url)}: {_first_line(e)}") from e

    def _refuse_foreign(self) -> None:
        """A database cachemgr never stamped with a revision must be empty: it never adds its
        tables beside another application's, even one whose tables have the names of its own (an
        `entries` table of another program once got cachemgr's other tables added beside it)."""
        from sqlalchemy import inspect

        try:
            with self.engine.connect() as conn:
                found = set(inspect(conn).get_table_names()) | set(inspect(conn).get_view_names())
        except SQLAlchemyError as e:
            raise DatabaseError(f"cannot open the index {redact_url(self.url)}: {_first_line(e)}") from e
        found.discard("alembic_version")  # (empty: its revision was None)
        if found and self.current_revision() is not None:
            return  # another process made the index meanwhile (its first scan): ours after all
        foreign = sorted(found)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            where = (
                "give cachemgr a database of its own, or a schema: CREATE SCHEMA cachemgr, then add "
                "?options=-csearch_path%3Dcachemgr to the URL"
                if not self.is_sqlite
                else "give it a file of its own"
            )
            raise DatabaseError(
                f"{redact_url(self.url)} holds tables that are not cachemgr's ({shown}): refusing to "
                f"add the index to it; {where}"
            )

    # -- sessions ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error."""
        with self.sessions() as s:
            try:
                with s.begin():
                    yield s
            except OperationalError as e:
                raise DatabaseError(f"index database error: {_first_line(e)}") from e

    def cache_id(self, host: str, root: str) -> int:
        """The row of (host, root), created on first use."""
        query = select(Cache.id).where(Cache.host == host, Cache.root == root)
        try:
            with self.session() as s:
                cid = s.scalar(query)
                if cid is None:
                    c = Cache(host=host, root=root)
                    s.add(c)
                    s.flush()
                    cid = c.id
                return cid
        except IntegrityError:  # another process of this host created it first (shared PostgreSQL)
            with self.session() as s:
                cid = s.scalar(query)
                assert cid is not None  # it is there: our insert lost to it
                return cid

    def close(self) -> None:
        self.engine.dispose()


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
