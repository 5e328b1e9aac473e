"""two-phase scan (entries indexed from names first, parsed after), parse results kept by content,
formats that do not record a field, torch/system fingerprints

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 14:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("entries") as b:
        b.add_column(sa.Column("dir", sa.String(length=1024), nullable=False, server_default=""))
        b.add_column(sa.Column("parse_state", sa.SmallInteger(), nullable=False, server_default="0"))
        b.add_column(sa.Column("unrecorded", sa.Text(), nullable=True))
        b.add_column(sa.Column("content", sa.String(length=64), nullable=True))
        b.create_index("ix_entries_cache_dir", ["cache_id", "dir"])
        b.create_index("ix_entries_cache_parse", ["cache_id", "parse_state"])
        b.create_index("ix_entries_content", ["content"])
    # rows from before: their home folder, derived as cachemgr.layout.home_dir does
    op.execute("UPDATE entries SET dir = CASE WHEN kind = 'triton' THEN key ELSE rtrim(key, replace(key, '/', '')) END")
    op.execute("UPDATE entries SET dir = substr(dir, 1, length(dir) - 1) WHERE kind <> 'triton' AND dir LIKE '%/'")
    op.create_table(
        "parsed_content",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("row", sa.JSON(), nullable=False),
        sa.Column("refs", sa.JSON(), nullable=False),
        sa.Column("parts", sa.JSON(), nullable=False),
        sa.Column("parsed_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", "bytes", name=op.f("pk_parsed_content")),
    )
    op.create_table(
        "fingerprints",
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("first_seen", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("kind", "hash", "host", name=op.f("pk_fingerprints")),
    )


def downgrade() -> None:
    op.drop_table("fingerprints")
    op.drop_table("parsed_content")
    with op.batch_alter_table("entries") as b:
        b.drop_index("ix_entries_content")
        b.drop_index("ix_entries_cache_parse")
        b.drop_index("ix_entries_cache_dir")
        b.drop_column("content")
        b.drop_column("unrecorded")
        b.drop_column("parse_state")
        b.drop_column("dir")
