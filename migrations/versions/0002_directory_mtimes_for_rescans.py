"""directory mtimes for rescans: a directory whose mtime has not moved is not read again

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 16:48:15.809190
"""

from alembic import op
import sqlalchemy as sa


revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dirs",
        sa.Column("cache_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("mtime_ns", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["cache_id"], ["caches.id"], name=op.f("fk_dirs_cache_id_caches"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("cache_id", "path", name=op.f("pk_dirs")),
    )


def downgrade() -> None:
    op.drop_table("dirs")
