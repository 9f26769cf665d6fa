"""alerts: each occurrence of an alert condition, from found to resolved

`alerts` holds one row per occurrence of a condition pipeline/alerts.py evaluates (a storage
worker down, content lost or under-replicated, a run unprotected, a disk above its watermark,
dead letters, a scrub overdue): since when it held, when it fired, when it was resolved and by
which job. The banner shows the open ones, the incidents page the history.

Existing data: nothing to carry over. Conditions that hold now are found by the scheduler's first
evaluation (with their own evidence's time where there is some: a worker's last answer, a run's
unprotected save); the repairs done before this revision are incidents already, read from their
repair jobs.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25 19:05:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("alert", sa.String(length=32), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("link", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolved_by", sa.Integer(), nullable=True),
        sa.Column("resolution", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_alerts"),
    )
    op.create_index("ix_alerts_since", "alerts", ["since"])
    op.create_index("uq_alerts_open_key", "alerts", ["key"], unique=True,
                    sqlite_where=sa.text("resolved_at IS NULL"), postgresql_where=sa.text("resolved_at IS NULL"))


def downgrade() -> None:
    op.drop_index("uq_alerts_open_key", table_name="alerts")
    op.drop_index("ix_alerts_since", table_name="alerts")
    op.drop_table("alerts")
