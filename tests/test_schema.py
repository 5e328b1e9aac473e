"""A fresh SQLite index is made from the models at head (no Alembic: a quarter of a first scan's
time to a usable index went to importing it and running five migrations). It must be the very
schema the migrations make: every table's columns (type, NOT NULL, default, key), indexes,
foreign keys and the view."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from cachemgr.index.db import Database, migrations_dir
from cachemgr.index.revision import HEAD_REVISION
from tests.conftest import subprocess_env


def schema(path) -> dict:
    conn = sqlite3.connect(path)
    out: dict = {}
    for kind, name, sql in conn.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"):
        if kind == "view":
            out[("view", name)] = " ".join(sql.split())
        elif kind == "table":
            out[("columns", name)] = sorted(tuple(r[1:]) for r in conn.execute(f"PRAGMA table_info('{name}')"))
            fks = conn.execute(f"PRAGMA foreign_key_list('{name}')")
            out[("foreign keys", name)] = sorted(tuple(r[2:]) for r in fks)
            for _, index, unique, origin, partial in conn.execute(f"PRAGMA index_list('{name}')"):
                columns = [r[2] for r in conn.execute(f"PRAGMA index_info('{index}')")]
                # (autoindexes of UNIQUE constraints are named by position: keyed by their columns)
                label = index if not index.startswith("sqlite_autoindex") else f"unique{columns}"
                out[("index", name, label)] = (unique, origin, partial, columns)
    conn.close()
    return out


def test_a_fresh_index_is_the_migrations_schema(tmp_path):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    made = tmp_path / "made.db"
    Database(f"sqlite:///{made}").close()
    migrated = tmp_path / "migrated.db"
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    engine = create_engine(f"sqlite:///{migrated}")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()

    a, b = schema(made), schema(migrated)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
    assert ("view", "entry_components") in a and ("columns", "entries") in a
    for path in (made, migrated):
        assert sqlite3.connect(path).execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD_REVISION,)]


def test_processes_opening_one_new_index_at_once_all_get_it(tmp_path):
    """Each process's creation runs in an immediate transaction: one makes the schema, the
    others wait and find it made (none fails on a table that already exists)."""
    url = f"sqlite:///{tmp_path / 'i.db'}"
    code = "import sys; from cachemgr.index.db import Database; print(Database(sys.argv[1]).current_revision())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url], env=subprocess_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 6
    assert outs == [HEAD_REVISION] * 6
    assert schema(tmp_path / "i.db") == schema_of_a_fresh_index(tmp_path / "one.db")


def schema_of_a_fresh_index(path) -> dict:
    Database(f"sqlite:///{path}").close()
    return schema(path)


def test_the_stored_ddl_is_the_models():
    """head_ddl.py is what SQLAlchemy makes of the models (after a change to them: `python -m
    cachemgr.index.schema` writes it again)."""
    from cachemgr.index.head_ddl import HEAD_DDL
    from cachemgr.index.schema import ddl_from_models

    assert ddl_from_models() == HEAD_DDL


def test_a_stdlib_connection_makes_the_same_index_and_refuses_what_it_should_not_touch(tmp_path):
    """schema.open_at_head (a first scan's phase one, before SQLAlchemy) makes the schema
    Database makes, and opens an index at head; anything else it leaves alone (None) for
    Database to migrate, refuse or report: another program's database, a file that is not
    SQLite, an index at an older revision, a folder that is missing."""
    from cachemgr.index.schema import open_at_head

    conn = open_at_head(str(tmp_path / "new.db"), create_folder=False)
    assert conn is not None
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert conn.execute("PRAGMA foreign_keys").fetchone() == (1,)
    conn.close()
    assert schema(tmp_path / "new.db") == schema_of_a_fresh_index(tmp_path / "fresh.db")
    again = open_at_head(str(tmp_path / "new.db"), create_folder=False)
    assert again is not None
    again.close()

    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE invoices (id INTEGER)")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database, " * 512)
    old = tmp_path / "old.db"
    Database(f"sqlite:///{old}").close()
    with sqlite3.connect(old) as c:
        c.execute("UPDATE alembic_version SET version_num = '0005'")
    before = {p: p.read_bytes() for p in (foreign, garbage)}
    for path in (foreign, garbage, old, tmp_path / "missing" / "i.db"):
        assert open_at_head(str(path), create_folder=False) is None, path
    assert {p: p.read_bytes() for p in (foreign, garbage)} == before
    assert not (tmp_path / "missing").exists()
    made = open_at_head(str(tmp_path / "state" / "cachemgr" / "i.db"), create_folder=True)
    assert made is not None
    made.close()
