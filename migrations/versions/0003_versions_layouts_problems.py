"""versions, layouts and detection problems

A checkpoint path keeps every version it had; ``current`` marks the newest (existing rows:
the highest id of each path). ``layout`` and ``completed_by`` record how detection judged it.
``detection_problems`` holds the entries detection reports instead of protecting.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 19:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("current", sa.Boolean(), server_default="1", nullable=False))
        batch_op.add_column(sa.Column("layout", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("completed_by", sa.String(length=16), nullable=True))
        batch_op.create_index("ix_checkpoints_run_current", ["run", "current"], unique=False)
    # Existing data: only the newest version of each path is current.
    checkpoints = sa.table("checkpoints", sa.column("id", sa.Integer), sa.column("path", sa.String),
                           sa.column("current", sa.Boolean))
    newer = sa.select(sa.literal(1)).select_from(checkpoints.alias("n")).where(
        sa.literal_column("n.path") == checkpoints.c.path, sa.literal_column("n.id") > checkpoints.c.id)
    op.execute(checkpoints.update().where(newer.exists()).values(current=False))

    op.create_table(
        "detection_problems",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=4096), nullable=False),
        sa.Column("run", sa.String(length=4096), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_detection_problems")),
        sa.UniqueConstraint("path", name=op.f("uq_detection_problems_path")),
    )
    with op.batch_alter_table("detection_problems", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_detection_problems_run"), ["run"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("detection_problems", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_detection_problems_run"))
    op.drop_table("detection_problems")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_run_current")
        batch_op.drop_column("completed_by")
        batch_op.drop_column("layout")
        batch_op.drop_column("current")
