"""the cost policy's GreedyDual clock, kept across eviction runs

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 13:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("caches") as b:
        b.add_column(sa.Column("gds_clock", sa.Float(), nullable=False, server_default="0"))
        b.add_column(sa.Column("gds_history", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("caches") as b:
        b.drop_column("gds_history")
        b.drop_column("gds_clock")
