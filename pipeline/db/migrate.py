"""Bring a control-plane database to the newest schema (Alembic owns the schema)."""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import migrations
from pipeline.db.engine import get_engine

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> None:
    """Upgrade ``url`` to head; safe to call from several processes at once.

    A database already at head is left alone without running the migration environment
    (whose integrity check reads every row): every command calls this first.
    """
    cfg = alembic_config(url)
    with get_engine(url).connect() as connection:
        if MigrationContext.configure(connection).get_current_heads() == \
                tuple(ScriptDirectory.from_config(cfg).get_heads()):
            connection.rollback()
            return
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
        connection.commit()
