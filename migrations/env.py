"""Alembic environment. cachemgr runs migrations in code (cachemgr.index.db.Database.migrate),
handing over its own connection; `alembic -x url=... upgrade head` works too."""

from alembic import context
from sqlalchemy import create_engine

from cachemgr.index.models import Base

target_metadata = Base.metadata


def run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")
    with create_engine(url).begin() as conn:
        run(conn)
