"""C++ builds the daemon indexed read again: it never read their source, so they have no alias

Up to 0006 the daemon's live batch re-read a changed entry without noting a code entry's C++
source (`.cpp`): a C++ build it indexed has no `src-` alias, so no graph names it and eviction
takes it for an orphan. Every code entry read and without an alias is marked to be read again
(parse_state 1, PENDING): the next scan reads it (its folder's names, its source) and names it; a
Python module, which has no source to name, is read again cheaply and stays as it was. Until
then eviction keeps it, as any entry waiting to be read.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 04:00:00
"""

from alembic import op


revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE entries SET parse_state = 1 WHERE kind = 'code' AND parse_state = 0 AND alias IS NULL")


def downgrade() -> None:
    pass  # (a row read again is as it was, or better named: nothing to undo)
