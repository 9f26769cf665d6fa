"""the current version of a path is what is on disk: a checkpoint whose files changed since

`checkpoints.disk_changed_at` (indexed) and `checkpoints.disk_changed`: set by the watcher of the
checkpoint's host when the files at its path no longer match the recorded (current) version and
the new content is not recorded yet (a re-save still being written, killed halfway, or a file
edited in place); cleared when the new content is recorded or the recorded content is back.
Status, the UI and /metrics show it loudly; a restore by path refuses it. Existing rows: NULL
(the next scan of each host's watcher sets it where it applies).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 13:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("disk_changed_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("disk_changed", sa.Text(), nullable=True))
    op.create_index("ix_checkpoints_disk_changed_at", "checkpoints", ["disk_changed_at"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_disk_changed_at", table_name="checkpoints")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("disk_changed")
        batch.drop_column("disk_changed_at")
