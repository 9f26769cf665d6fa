"""training hosts get a label (their hostname)

A host is named by an id kept beside its home (pipeline/hostid.py), first written with the
hostname, so the rows recorded under a hostname keep their host. `hosts.label`: the hostname the
host last reported with, shown beside the id. Existing data: each host's label is its name (the
hostname it was recorded under). Whether a host's queue is consumed is the queue's beat
(`queue_consumers`, revision 0011).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("label", sa.String(length=255), nullable=True))
    op.execute("UPDATE hosts SET label = name")


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("label")
