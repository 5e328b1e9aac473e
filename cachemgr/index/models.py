"""The index schema (SQLAlchemy 2.x typed ORM). Alembic's migrations in migrations/ build it.

One database can hold many caches (host + root): the embedded default holds one, the fleet tier
(PostgreSQL) holds every host's. Rows that point at other entries do so by (kind, ref) strings,
not ids, because the target may not be on disk (an AOT entry whose forward graph was evicted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)

    if TYPE_CHECKING:
        # Declarative types it as any FromClause; every model here is mapped to a Table (one its
        # __tablename__ makes, or one of its own), which insert(), update() and delete() take.
        __table__: ClassVar[Table]


class Cache(Base):
    """One cache directory on one host."""

    __tablename__ = "caches"
    __table_args__ = (UniqueConstraint("host", "root"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    root: Mapped[str] = mapped_column(String(1024))
    last_scan: Mapped[float | None] = mapped_column(Float)
    last_eviction: Mapped[float | None] = mapped_column(Float)
    # the cost policy's GreedyDual clock, and the times it rose ([[time, value], ...]): kept across runs
    gds_clock: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    gds_history: Mapped[list | None] = mapped_column(JSON)
    reader: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # parse.READER that read its entries


def _where(column: str) -> dict:
    """An index of the rows where `column` is set. SQLite's only: the models make a fresh SQLite
    index (schema.HEAD_DDL, made from them), the migrations make every other (their 0006 has PostgreSQL's
    partial indexes). A `postgresql_where` here made SQLAlchemy import its PostgreSQL dialect,
    and asyncio, into every command: 40-60 ms of each."""
    return {"sqlite_where": text(f"{column} IS NOT NULL")}


class Entry(Base):
    """One cache entry (see cachemgr.layout for what an entry is per kind)."""

    __tablename__ = "entries"
    __table_args__ = (
        UniqueConstraint("cache_id", "key"),
        # totals by kind read this index alone (`stats`: the rows are wide; not parse_state, which
        # phase two sets on every entry it reads: the pending count reads ix_entries_cache_parse)
        Index("ix_entries_usage", "cache_id", "kind", "bytes", "files", "mtime"),
        Index("ix_entries_corrupt", "cache_id", **_where("corrupt")),
        Index("ix_entries_cache_ref", "cache_id", "ref"),
        # partial: most entries have no alias, graph key or content name (phase one sets none)
        Index("ix_entries_cache_alias", "cache_id", "alias", **_where("alias")),
        Index("ix_entries_cache_graph", "cache_id", "graph_key", **_where("graph_key")),
        Index("ix_entries_cache_dir", "cache_id", "dir"),
        Index("ix_entries_cache_parse", "cache_id", "parse_state"),
        Index("ix_entries_content", "content", **_where("content")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cache_id: Mapped[int] = mapped_column(ForeignKey("caches.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(1024))  # path relative to the root
    # the folder whose listing holds it (layout.home_dir)
    dir: Mapped[str] = mapped_column(String(1024), default="", server_default="")
    kind: Mapped[str] = mapped_column(String(16))
    ref: Mapped[str | None] = mapped_column(String(128))  # the name other entries use for it
    alias: Mapped[str | None] = mapped_column(String(64))  # second name (C++ kernel source hash)
    bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    mtime: Mapped[float] = mapped_column(Float)
    first_seen: Mapped[float] = mapped_column(Float)
    last_access: Mapped[float] = mapped_column(Float)
    hit_count: Mapped[int] = mapped_column(Integer, default=0)
    graph_key: Mapped[str | None] = mapped_column(String(64))
    signature: Mapped[str | None] = mapped_column(Text)
    signature_hash: Mapped[str | None] = mapped_column(String(16))
    options_hash: Mapped[str | None] = mapped_column(String(16))
    guards: Mapped[str | None] = mapped_column(Text)
    device_types: Mapped[str | None] = mapped_column(String(64))
    compile_seconds: Mapped[float | None] = mapped_column(Float)
    torch_version: Mapped[str | None] = mapped_column(String(64))
    torch_version_hash: Mapped[str | None] = mapped_column(String(64))
    system_hash: Mapped[str | None] = mapped_column(String(64))
    corrupt: Mapped[str | None] = mapped_column(Text)
    # vocab.PARSED: its files were read; PENDING / PENDING_NEW: indexed from its names only (scan
    # phase one), to be read (phase two). Whatever needs parsed fields treats a pending entry as unknown: kept.
    parse_state: Mapped[int] = mapped_column(SmallInteger, default=0, server_default="0")
    unrecorded: Mapped[str | None] = mapped_column(Text)  # what this entry's format does not record, ', '-joined
    content: Mapped[str | None] = mapped_column(String(64))  # an entry file named by its bytes' hash: that name

    refs: Mapped[list[EntryRef]] = relationship(cascade="all, delete-orphan", passive_deletes=True)


class ParsedContent(Base):
    """What parsing an entry file gave, kept by the file's content name and size: torch names
    fxgraph and AOTAutograd entry files by the hash of their bytes, so a rescan, a restored cache
    and every other host of a fleet index parse each distinct entry once."""

    __tablename__ = "parsed_content"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    row: Mapped[dict] = mapped_column(JSON)  # the entry's parsed columns
    refs: Mapped[list] = mapped_column(JSON)  # [[kind, ref], ...]
    parts: Mapped[dict] = mapped_column(JSON)  # part -> component set digest
    parsed_at: Mapped[float] = mapped_column(Float)
    # parse.READER that made it: another's is not taken
    reader: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Fingerprint(Base):
    """What a torch build (or a host's system) is called: the hash an fxgraph entry records as
    its `torch_version` (or `system_info`) component, learned from a process that runs that torch
    (the recorder, the prewarm worker, `cachemgr check`). It names entries whose format records
    only the hash, and says which builds a host still runs (`purge --stale`)."""

    __tablename__ = "fingerprints"

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # 'torch' | 'system'
    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))  # '2.14.1+cu130'; for a system: 'NVIDIA H200, CUDA 13.0'
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)


class Dir(Base):
    """A directory's mtime when the scanner last read it: while it stays the same, the directory
    holds the same names, and a rescan does not read it again (cachemgr.layout.walk_dirs)."""

    __tablename__ = "dirs"

    cache_id: Mapped[int] = mapped_column(ForeignKey("caches.id", ondelete="CASCADE"), primary_key=True)
    path: Mapped[str] = mapped_column(String(1024), primary_key=True)  # relative to the root, "" is the root
    mtime_ns: Mapped[int] = mapped_column(BigInteger)  # -1: too recent to trust, read it again


class EntryRef(Base):
    """Entry `entry_id` needs the entry of `kind` whose ref (or alias) is `ref`."""

    __tablename__ = "entry_refs"
    __table_args__ = (Index("ix_entry_refs_kind_ref", "kind", "ref"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    entry_id: Mapped[int] = mapped_column(ForeignKey("entries.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    ref: Mapped[str] = mapped_column(String(128))


class ComponentSet(Base):
    """A deduplicated set of hash components: one part (code, inputs, options, environment)
    of an fxgraph key. Hundreds of graphs share one options set, so a scan stores it once."""

    __tablename__ = "component_sets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(32), unique=True)
    part: Mapped[str] = mapped_column(String(16))


class ComponentSetItem(Base):
    __tablename__ = "component_set_items"

    set_id: Mapped[int] = mapped_column(ForeignKey("component_sets.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    hash: Mapped[str] = mapped_column(String(64))
    value: Mapped[str] = mapped_column(Text)


class EntryComponentSet(Base):
    __tablename__ = "entry_component_sets"

    entry_id: Mapped[int] = mapped_column(ForeignKey("entries.id", ondelete="CASCADE"), primary_key=True)
    part: Mapped[str] = mapped_column(String(16), primary_key=True)
    set_id: Mapped[int] = mapped_column(ForeignKey("component_sets.id", ondelete="CASCADE"), index=True)


# entry_components is a read-only view (created by migration 0001): one row per component an
# entry's key was hashed from. It lives in its own MetaData so Alembic never takes it for a table.
VIEWS = MetaData()
ENTRY_COMPONENTS_VIEW = (  # as migration 0001 made it (a fresh SQLite index is made from these models)
    "CREATE VIEW entry_components AS SELECT ecs.entry_id AS entry_id, ecs.part AS part, i.name AS name, "
    "i.hash AS hash, i.value AS value FROM entry_component_sets ecs "
    "JOIN component_set_items i ON i.set_id = ecs.set_id"
)


class EntryComponent(Base):
    """One component an fxgraph key was hashed from (`_fx_graph_cache_debug_lines`)."""

    __table__ = Table(
        "entry_components",
        VIEWS,
        Column("entry_id", Integer, primary_key=True),
        Column("part", String(16)),
        Column("name", String(255), primary_key=True),
        Column("hash", String(64)),
        Column("value", Text),
    )


class Pin(Base):
    """A key (entry key, graph key or ref) eviction must keep. Outlives the entry's rows."""

    __tablename__ = "pins"
    __table_args__ = (UniqueConstraint("cache_id", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cache_id: Mapped[int] = mapped_column(ForeignKey("caches.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(1024))
    reason: Mapped[str | None] = mapped_column(Text)
    created: Mapped[float] = mapped_column(Float)


class Event(Base):
    """What happened to the cache: 'new' (a compile wrote an entry), 'hit', 'evict'."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_cache_ts", "cache_id", "ts"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cache_id: Mapped[int] = mapped_column(ForeignKey("caches.id", ondelete="CASCADE"))
    ts: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    entry_kind: Mapped[str | None] = mapped_column(String(16))
    entry_key: Mapped[str | None] = mapped_column(String(1024))
    graph_key: Mapped[str | None] = mapped_column(String(64))
    recompile: Mapped[bool] = mapped_column(Boolean, default=False)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    seconds: Mapped[float | None] = mapped_column(Float)


class Shape(Base):
    """One input signature a model was seen with in production (cachemgr.record)."""

    __tablename__ = "shapes"
    __table_args__ = (UniqueConstraint("model", "signature_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(255))
    signature_hash: Mapped[str] = mapped_column(String(16))
    signature: Mapped[str] = mapped_column(Text)
    spec: Mapped[str] = mapped_column(Text)  # JSON: the inputs, replayable by prewarm
    options: Mapped[str] = mapped_column(Text)  # JSON: torch.compile kwargs
    host: Mapped[str | None] = mapped_column(String(255))
    count: Mapped[int] = mapped_column(BigInteger, default=1)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
