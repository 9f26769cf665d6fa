"""Alembic environment: online migrations only, batch mode for SQLite."""
from __future__ import annotations

from alembic import context
from sqlalchemy import text

from pipeline.db.engine import make_engine
from pipeline.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url"))
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connection)


def _run(connection) -> None:
    is_sqlite = connection.dialect.name == "sqlite"
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=is_sqlite)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Several processes start at once and all upgrade to head: serialize them.
            connection.execute(text("SELECT pg_advisory_xact_lock(74616901)"))
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run against a database URL")
run_migrations_online()
