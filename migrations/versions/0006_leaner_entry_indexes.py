"""entry indexes for a million files: totals from one covering index, NULL-only columns out of theirs

`stats` summed every entry row (wide: signatures, guards) for its totals by kind: 0.3 s at
1,000,000 files. The (cache_id, kind) index becomes a covering one of the columns totals read,
and corrupt rows get a partial index of their own. The alias, graph key and content indexes
hold only rows that have one (most have none, and phase one writes none): inserts skip them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 18:45:00
"""

from alembic import op
import sqlalchemy as sa


revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

PARTIAL = {  # index -> its column, indexed where it is not NULL
    "ix_entries_cache_alias": "alias",
    "ix_entries_cache_graph": "graph_key",
    "ix_entries_content": "content",
}


def _where(column: str) -> dict:
    return {"sqlite_where": sa.text(f"{column} IS NOT NULL"), "postgresql_where": sa.text(f"{column} IS NOT NULL")}


def upgrade() -> None:
    op.drop_index("ix_entries_cache_kind", table_name="entries")
    op.create_index("ix_entries_usage", "entries", ["cache_id", "kind", "bytes", "files", "mtime"])
    op.create_index("ix_entries_corrupt", "entries", ["cache_id"], **_where("corrupt"))
    for name, column in PARTIAL.items():
        op.drop_index(name, table_name="entries")
        columns = [column] if column == "content" else ["cache_id", column]
        op.create_index(name, "entries", columns, **_where(column))


def downgrade() -> None:
    for name, column in PARTIAL.items():
        op.drop_index(name, table_name="entries")
        op.create_index(name, "entries", [column] if column == "content" else ["cache_id", column])
    op.drop_index("ix_entries_corrupt", table_name="entries")
    op.drop_index("ix_entries_usage", table_name="entries")
    op.create_index("ix_entries_cache_kind", "entries", ["cache_id", "kind"])
