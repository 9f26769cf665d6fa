"""a copy of recorded content takes the original's completion time: checkpoints by version

Recording a checkpoint looks up the earliest completion time of the same content
(`checkpoints.version`) anywhere in the catalog, so a copy of an old checkpoint (`cp -r`, a
restore next to the run) never ranks newer than a later save. An index on `version` keeps that
lookup one index probe. Existing data needs nothing.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25 13:50:00
"""
from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_checkpoints_version", "checkpoints", ["version"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_version", table_name="checkpoints")
