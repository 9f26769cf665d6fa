"""The Alembic revisions, on SQLite and PostgreSQL: they round-trip and build what the models say."""
from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from pipeline.db.engine import get_engine
from pipeline.db.migrate import alembic_config
from pipeline.db.models import Base


def test_migrations_round_trip_and_match_the_models(db):
    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "base")
        command.upgrade(cfg, "head")
        conn.commit()
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == []
