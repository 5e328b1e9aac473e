"""the version of cachemgr's entry readers that filled a cache's rows and each kept parse result

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 16:30:00
"""

from alembic import op
import sqlalchemy as sa


revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # 0: read by a cachemgr from before readers had a version: everything is read again once
    with op.batch_alter_table("caches") as b:
        b.add_column(sa.Column("reader", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("parsed_content") as b:
        b.add_column(sa.Column("reader", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("parsed_content") as b:
        b.drop_column("reader")
    with op.batch_alter_table("caches") as b:
        b.drop_column("reader")
