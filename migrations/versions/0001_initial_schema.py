"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-12-02 12:57:50.140688
"""

from alembic import op
import sqlalchemy as sa


revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "caches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("root", sa.String(length=1024), nullable=False),
        sa.Column("last_scan", sa.Float(), nullable=True),
        sa.Column("last_eviction", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_caches")),
        sa.UniqueConstraint("host", "root", name=op.f("uq_caches_host")),
    )
    op.create_table(
        "component_sets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=32), nullable=False),
        sa.Column("part", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_component_sets")),
        sa.UniqueConstraint("digest", name=op.f("uq_component_sets_digest")),
    )
    op.create_table(
        "shapes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("signature_hash", sa.String(length=16), nullable=False),
        sa.Column("signature", sa.Text(), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("options", sa.Text(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("first_seen", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_shapes")),
        sa.UniqueConstraint("model", "signature_hash", name=op.f("uq_shapes_model")),
    )
    op.create_table(
        "component_set_items",
        sa.Column("set_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["set_id"],
            ["component_sets.id"],
            name=op.f("fk_component_set_items_set_id_component_sets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("set_id", "name", name=op.f("pk_component_set_items")),
    )
    op.create_table(
        "entries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cache_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=1024), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("ref", sa.String(length=128), nullable=True),
        sa.Column("alias", sa.String(length=64), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("mtime", sa.Float(), nullable=False),
        sa.Column("first_seen", sa.Float(), nullable=False),
        sa.Column("last_access", sa.Float(), nullable=False),
        sa.Column("hit_count", sa.Integer(), nullable=False),
        sa.Column("graph_key", sa.String(length=64), nullable=True),
        sa.Column("signature", sa.Text(), nullable=True),
        sa.Column("signature_hash", sa.String(length=16), nullable=True),
        sa.Column("options_hash", sa.String(length=16), nullable=True),
        sa.Column("guards", sa.Text(), nullable=True),
        sa.Column("device_types", sa.String(length=64), nullable=True),
        sa.Column("compile_seconds", sa.Float(), nullable=True),
        sa.Column("torch_version", sa.String(length=64), nullable=True),
        sa.Column("torch_version_hash", sa.String(length=64), nullable=True),
        sa.Column("system_hash", sa.String(length=64), nullable=True),
        sa.Column("corrupt", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["cache_id"], ["caches.id"], name=op.f("fk_entries_cache_id_caches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_entries")),
        sa.UniqueConstraint("cache_id", "key", name=op.f("uq_entries_cache_id")),
    )
    with op.batch_alter_table("entries", schema=None) as batch_op:
        batch_op.create_index("ix_entries_cache_alias", ["cache_id", "alias"], unique=False)
        batch_op.create_index("ix_entries_cache_graph", ["cache_id", "graph_key"], unique=False)
        batch_op.create_index("ix_entries_cache_kind", ["cache_id", "kind"], unique=False)
        batch_op.create_index("ix_entries_cache_ref", ["cache_id", "ref"], unique=False)

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cache_id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("entry_kind", sa.String(length=16), nullable=True),
        sa.Column("entry_key", sa.String(length=1024), nullable=True),
        sa.Column("graph_key", sa.String(length=64), nullable=True),
        sa.Column("recompile", sa.Boolean(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["cache_id"], ["caches.id"], name=op.f("fk_events_cache_id_caches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_cache_ts", ["cache_id", "ts"], unique=False)

    op.create_table(
        "pins",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cache_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=1024), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["cache_id"], ["caches.id"], name=op.f("fk_pins_cache_id_caches"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pins")),
        sa.UniqueConstraint("cache_id", "key", name=op.f("uq_pins_cache_id")),
    )
    op.create_table(
        "entry_component_sets",
        sa.Column("entry_id", sa.Integer(), nullable=False),
        sa.Column("part", sa.String(length=16), nullable=False),
        sa.Column("set_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["entry_id"], ["entries.id"], name=op.f("fk_entry_component_sets_entry_id_entries"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["set_id"],
            ["component_sets.id"],
            name=op.f("fk_entry_component_sets_set_id_component_sets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("entry_id", "part", name=op.f("pk_entry_component_sets")),
    )
    with op.batch_alter_table("entry_component_sets", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_entry_component_sets_set_id"), ["set_id"], unique=False)

    op.create_table(
        "entry_refs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("entry_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("ref", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["entry_id"], ["entries.id"], name=op.f("fk_entry_refs_entry_id_entries"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_entry_refs")),
    )
    with op.batch_alter_table("entry_refs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_entry_refs_entry_id"), ["entry_id"], unique=False)
        batch_op.create_index("ix_entry_refs_kind_ref", ["kind", "ref"], unique=False)

    # one row per component an entry's key was hashed from, over the deduplicated sets
    op.execute(
        "CREATE VIEW entry_components AS SELECT ecs.entry_id AS entry_id, ecs.part AS part, i.name AS name, "
        "i.hash AS hash, i.value AS value FROM entry_component_sets ecs "
        "JOIN component_set_items i ON i.set_id = ecs.set_id"
    )


def downgrade() -> None:
    op.execute("DROP VIEW entry_components")
    with op.batch_alter_table("entry_refs", schema=None) as batch_op:
        batch_op.drop_index("ix_entry_refs_kind_ref")
        batch_op.drop_index(batch_op.f("ix_entry_refs_entry_id"))

    op.drop_table("entry_refs")
    with op.batch_alter_table("entry_component_sets", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_entry_component_sets_set_id"))

    op.drop_table("entry_component_sets")
    op.drop_table("pins")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_cache_ts")

    op.drop_table("events")
    with op.batch_alter_table("entries", schema=None) as batch_op:
        batch_op.drop_index("ix_entries_cache_ref")
        batch_op.drop_index("ix_entries_cache_kind")
        batch_op.drop_index("ix_entries_cache_graph")
        batch_op.drop_index("ix_entries_cache_alias")

    op.drop_table("entries")
    op.drop_table("component_set_items")
    op.drop_table("shapes")
    op.drop_table("component_sets")
    op.drop_table("caches")
