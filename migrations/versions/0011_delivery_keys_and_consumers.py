"""at most one outstanding message per job step; which queues have a live consumer

Each message of a step the scheduler re-drives carries a key (its Dramatiq message id), recorded
on the row it works for before it is enqueued: `jobs.sent_key`/`sent_at` for a job's step,
`copies.sent_key`/`sent_at` for a copy's replicate. A delivery whose key is no longer the row's is
dropped without work. `jobs.waiting_for` names the queue a job's next message waits for (no live
consumer: its host is down). `queue_consumers` holds each queue's last consumer heartbeat.

Existing rows: the new columns are NULL, which means "no key recorded": any delivery of them is
accepted (messages in flight at the upgrade run as before), and the next send records a key.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("sent_key", sa.String(64), nullable=True))
        batch.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("waiting_for", sa.String(255), nullable=True))
    with op.batch_alter_table("copies") as batch:
        batch.add_column(sa.Column("sent_key", sa.String(64), nullable=True))
        batch.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_jobs_waiting_for", "jobs", ["waiting_for"])
    op.create_table(
        "queue_consumers",
        sa.Column("queue", sa.String(255), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("queue", name="pk_queue_consumers"),
    )


def downgrade() -> None:
    op.drop_table("queue_consumers")
    op.drop_index("ix_jobs_waiting_for", table_name="jobs")
    with op.batch_alter_table("copies") as batch:
        batch.drop_column("sent_at")
        batch.drop_column("sent_key")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("waiting_for")
        batch.drop_column("sent_at")
        batch.drop_column("sent_key")
