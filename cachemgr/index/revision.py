"""The newest migration in migrations/versions, importable without SQLAlchemy.

A test holds it equal to Alembic's head, so the common start-up (schema already current) never
imports Alembic, and `stats` on SQLite never imports SQLAlchemy.
"""

HEAD_REVISION = "0007"
