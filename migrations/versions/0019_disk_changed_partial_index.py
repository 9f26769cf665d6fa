"""the checkpoints changed on disk: a partial index that holds only them

``ckpt status``, the overview and the runs view count, per run, the current checkpoints whose
files on disk are not their recorded version (``disk_changed_at`` set: pipeline.detection.ondisk).
There are a handful at most, but the index on ``disk_changed_at`` held every checkpoint (NULL for
nearly all), and once ``PRAGMA optimize`` had counted it SQLite judged it useless and scanned the
table (~25 ms at 100k checkpoints, every page and status). A partial index on ``(run, current)``
``WHERE disk_changed_at IS NOT NULL`` holds only the flagged checkpoints, and covers the count:
under 0.1 ms whatever the statistics say. It replaces the full index, which nothing else reads
(the watcher's start reads the flagged paths of its host along the host's own index).

Existing data: the index is built from the rows.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26 08:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

FLAGGED = "disk_changed_at IS NOT NULL"


def upgrade() -> None:
    op.drop_index("ix_checkpoints_disk_changed_at", table_name="checkpoints")
    op.create_index("ix_checkpoints_disk_changed", "checkpoints", ["run", "current"],
                    sqlite_where=sa.text(FLAGGED), postgresql_where=sa.text(FLAGGED))


def downgrade() -> None:
    op.drop_index("ix_checkpoints_disk_changed", table_name="checkpoints")
    op.create_index("ix_checkpoints_disk_changed_at", "checkpoints", ["disk_changed_at"])
