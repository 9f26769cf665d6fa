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


def test_0003_marks_only_the_newest_version_of_each_path_current(db):
    """Existing databases: every older version of a path stops being current, data kept."""
    from sqlalchemy import text

    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002")
        conn.commit()
        for i, path in enumerate(["/r/a", "/r/a", "/r/b", "/r/a"], start=1):
            conn.execute(text(
                "INSERT INTO checkpoints (id, path, run, name, is_dir, version, step, mtime, total_bytes,"
                " local_present, detected_at) VALUES (:i, :p, '/r', 'x', false, :v, NULL, 0, 1, true,"
                " '2026-11-21 00:00:00')"), {"i": i, "p": path, "v": f"v{i}"})
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
        rows = dict(conn.execute(text("SELECT id, current FROM checkpoints ORDER BY id")).all())
        command.downgrade(cfg, "0002")  # the other tests start from an empty database at head
        conn.execute(text("DELETE FROM checkpoints"))
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
    assert {i: bool(c) for i, c in rows.items()} == {1: False, 2: False, 3: True, 4: True}
