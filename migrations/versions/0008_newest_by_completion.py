""""newest" is the most recently completed save: the runs' newest checkpoints by completion time

A run's newest checkpoint is the one whose content was complete last (its newest file's
modification time, `checkpoints.mtime`), then the writer's step, then detection order
(pipeline.core.retention.recency), no longer the step in its name. The index that served
"newest by step" (run, current, step, id) becomes (run, current, mtime, id). Existing data
needs nothing: `mtime` has always been the newest file's modification time.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 13:00:00
"""
from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_checkpoints_run_recent", "checkpoints", ["run", "current", "mtime", "id"])
    op.drop_index("ix_checkpoints_run_step", table_name="checkpoints")


def downgrade() -> None:
    op.create_index("ix_checkpoints_run_step", "checkpoints", ["run", "current", "step", "id"])
    op.drop_index("ix_checkpoints_run_recent", table_name="checkpoints")
