"""The embedded SQLite index without SQLAlchemy: the DDL of a fresh index at head, the pragmas
every connection takes, and a stdlib connection that may make the file.

Importing SQLAlchemy costs about as much as `find` over a 100,000-file cache, so a first scan's
phase one (cachemgr.index.fill) runs on the standard library's sqlite3 and the index it makes
is usable before SQLAlchemy is imported. The DDL is made from the models
(`python -m cachemgr.index.schema` writes cachemgr/index/head_ddl.py again); tests hold it equal
to the models and to what the migrations make, column by column.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

from cachemgr.errors import DatabaseError
from cachemgr.index.head_ddl import HEAD_DDL
from cachemgr.index.revision import HEAD_REVISION

PRAGMAS = (
    "PRAGMA synchronous=NORMAL",  # safe with WAL; a crash loses at most the last commit
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=30000",
    # 8 MiB of pages (SQLite's default is 2): a first scan of 1,000,000 files writes eight indexes
    # of 200,000+ rows, and with 2 MiB each insert read its pages back from the OS again. (32 MiB
    # was 12 % faster still, but it counts in every process's memory, held under 150 MB.)
    "PRAGMA cache_size=-8192",
)
STAMP = (
    "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
    "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
)


def apply_pragmas(conn) -> None:
    """Per connection (a DB-API connection: stdlib sqlite3's, or the one under SQLAlchemy's).
    WAL (readers never block the daemon's writes) is the file's own setting, set where it is made."""
    cur = conn.cursor()
    for pragma in PRAGMAS:
        cur.execute(pragma)
    cur.close()


def create_at_head(conn) -> bool:
    """Make the schema at head in an empty SQLite file, inside the caller's immediate
    transaction (one process makes it; the others, waiting on the lock, then find it made).
    False if the file holds anything already."""
    cur = conn.cursor()
    try:
        if cur.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is not None:
            return False
        for ddl in (*HEAD_DDL, STAMP):
            cur.execute(ddl)
        cur.execute("INSERT INTO alembic_version (version_num) VALUES (?)", (HEAD_REVISION,))
        return True
    finally:
        cur.close()


def folder_for(path: Path, create: bool) -> None:
    """The folder of a SQLite index: made only when asked (cachemgr's default state folder)."""
    folder = path.parent
    if folder.is_dir():
        return
    if not create:
        what = "is not a folder" if folder.exists() else "does not exist"
        raise DatabaseError(
            f"the index's folder {folder} {what}: cachemgr creates only its default state folder "
            "(create it, or give another --db)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(f"cannot create the index folder {folder}: {e.strerror}") from e


def use_wal(conn: sqlite3.Connection, wait: float = 30.0) -> None:
    """Put the index at `conn` (a stdlib connection, no transaction open) in WAL mode, which the
    file keeps. Processes opening one new index at once: setting it takes a lock that SQLite's
    busy timeout does not wait for ("database is locked" at once), so it is asked again until
    `wait` seconds have passed; one that finds it set already sets nothing."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def open_at_head(path: str, create_folder: bool) -> sqlite3.Connection | None:
    """A stdlib connection (autocommit, the pragmas taken) to the SQLite index at `path`, made
    at head if the file is new or empty. None where it is anything else: an index at another
    revision, another program's database, a file that will not open. `Database` then migrates it,
    refuses it or says why, as it always does."""
    try:
        folder_for(Path(path), create_folder)
        new = not os.path.exists(path)
        conn = sqlite3.connect(f"file:{quote(path)}?mode=rwc", uri=True, timeout=30, isolation_level=None)
    except (DatabaseError, sqlite3.Error, OSError):
        return None
    try:
        apply_pragmas(conn)
        if new or conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is None:
            use_wal(conn)  # (not inside a transaction)
            conn.execute("BEGIN IMMEDIATE")
            try:
                create_at_head(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        if conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD_REVISION,)]:
            keep_reserve(Path(f"{path}.reserve"))  # (as `Database` does: room to evict on a full disk)
            return conn
    except sqlite3.Error:
        pass
    conn.close()
    return None


RESERVE_BYTES = 8 << 20  # beside a SQLite index: room to open it and record an eviction on a full disk


def disk_full(e: BaseException) -> bool:
    text = str(e).lower()
    return "disk i/o error" in text or "disk is full" in text or "no space left" in text


def no_room(reserve: Path | None) -> str:
    """Why SQLite may not open or write a file beside `reserve` (the index's own): its file system
    has no free inodes (the reserve cannot help: -wal and -shm are new files), or no free space;
    '' if neither, or not known."""
    if reserve is None:
        return ""
    try:
        st = os.statvfs(reserve.parent)
    except OSError:
        return ""
    if st.f_files and not st.f_ffree:
        return f" (the file system of {reserve.parent} has no free inodes)"
    if not st.f_bfree:
        return f" (the file system of {reserve.parent} is full)"
    return ""


def release_reserve(reserve: Path) -> bool:
    try:
        reserve.unlink()
        return True
    except OSError:
        return False


def keep_reserve(reserve: Path) -> None:
    """Hold RESERVE_BYTES beside the index while the disk has room (made again after a release)."""
    try:
        if reserve.exists():
            return
        fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError:  # no room now: try again next time
        os.close(fd)
        release_reserve(reserve)
        return
    os.close(fd)


def ddl_from_models() -> tuple[str, ...]:
    """The DDL SQLAlchemy makes of the models for SQLite (tables, each followed by its indexes),
    then the view: what HEAD_DDL must hold."""
    from sqlalchemy.dialects import sqlite
    from sqlalchemy.schema import CreateIndex, CreateTable

    from cachemgr.index.models import ENTRY_COMPONENTS_VIEW, Base

    dialect = sqlite.dialect()
    out = []
    for table in Base.metadata.sorted_tables:
        out.append(str(CreateTable(table).compile(dialect=dialect)).strip())
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            out.append(str(CreateIndex(index).compile(dialect=dialect)).strip())
    out.append(ENTRY_COMPONENTS_VIEW)
    return tuple(out)


def main() -> None:
    """Write head_ddl.py from the models (after a change to the models and its migration)."""
    target = Path(__file__).with_name("head_ddl.py")
    body = ""
    for ddl in ddl_from_models():  # a statement per parenthesized group, a string per line of it
        lines = ddl.splitlines(keepends=True)
        body += "    (\n" + "".join(f"        {line!r}\n" for line in lines) + "    ),\n"
    target.write_text(
        '"""The DDL of a fresh SQLite index at head, made from the models by `python -m\n'
        "cachemgr.index.schema` (do not edit: run that after changing the models and adding their\n"
        'migration). tests/test_schema.py holds it equal to the models and to the migrations."""\n\n'
        f"HEAD_DDL = (\n{body})\n"
    )
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
