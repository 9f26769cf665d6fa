"""each checkpoint shows the state of its newest store job

`checkpoints.store_state` holds the state of the checkpoint's newest store job, kept by
create_job() and transition() in the transaction that changes the job, so that counts by run
and state read one index instead of grouping every job (docs/design.md, "the checkpoint's
state"). Existing data: filled from each checkpoint's newest store job (NULL when it has none).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 01:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("store_state", sa.String(length=16), nullable=True))
    op.execute(
        "UPDATE checkpoints SET store_state = (SELECT j.state FROM jobs j WHERE j.id = ("
        "SELECT max(k.id) FROM jobs k WHERE k.kind = 'store' AND k.checkpoint_id = checkpoints.id))")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoints_run_state", ["run", "current", "store_state", "local_present", "total_bytes"],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_run_state")
        batch_op.drop_column("store_state")
