"""Bring a control-plane database to the newest schema (Alembic owns the schema)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import text

import migrations
from pipeline.db.engine import get_engine

if TYPE_CHECKING:
    from alembic.config import Config

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)
_REVISION = re.compile(r"""^revision(?:\s*:\s*str)?\s*=\s*["']([^"']+)["']""", re.M)
_DOWN = re.compile(r"^down_revision\b[^=\n]*=(.*)$", re.M)


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def heads_on_disk() -> set[str]:
    """The newest revisions of ``migrations/versions``, read from the files' text: Alembic's
    own way imports Alembic and every revision module (a tenth of a second for every
    command). Held to Alembic's answer by a test."""
    revisions, replaced = set(), set()
    for path in Path(SCRIPT_LOCATION, "versions").glob("*.py"):
        source = path.read_text()
        if (rev := _REVISION.search(source)) is None:
            continue
        revisions.add(rev.group(1))
        if (down := _DOWN.search(source)) is not None:
            replaced.update(re.findall(r"""["']([^"']+)["']""", down.group(1)))
    return revisions - replaced


def upgrade(url: str) -> None:
    """Upgrade ``url`` to head; safe to call from several processes at once.

    A database already at head is left alone without running the migration environment
    (whose integrity check reads every row), nor importing Alembic: every command calls
    this first.
    """
    with get_engine(url).connect() as connection:
        try:
            current = {row[0] for row in connection.execute(text("SELECT version_num FROM alembic_version"))}
        except Exception:  # no schema yet (or not ours): Alembic decides below
            current = set()
        connection.rollback()
        if current and current == heads_on_disk():
            return
        from alembic import command
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        cfg = alembic_config(url)
        if MigrationContext.configure(connection).get_current_heads() == \
                tuple(ScriptDirectory.from_config(cfg).get_heads()):
            connection.rollback()
            return
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
        connection.commit()
