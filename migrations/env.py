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
    # SQLite's batch mode rebuilds a table by copy, drop and rename: with foreign keys
    # enforced, dropping a table other rows reference fails. They are off while the
    # revisions run (the pragma only works outside a transaction) and every reference is
    # checked before the commit.
    raw = connection.connection.dbapi_connection if is_sqlite else None
    toggled = raw is not None and not raw.in_transaction
    if toggled:
        raw.execute("PRAGMA foreign_keys=OFF")
    try:
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # Several processes start at once and all upgrade to head: serialize them.
                connection.execute(text("SELECT pg_advisory_xact_lock(74616901)"))
            context.run_migrations()
            if toggled:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"the migration left rows referencing nothing: {broken[:5]}")
    finally:
        if toggled:
            raw.execute("PRAGMA foreign_keys=ON")


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run against a database URL")
run_migrations_online()
