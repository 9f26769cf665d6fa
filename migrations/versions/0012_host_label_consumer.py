"""training hosts get a label (their hostname) and a consumer heartbeat

A host is named by an id kept beside its home (pipeline/hostid.py), first written with the
hostname, so the rows recorded under a hostname keep their host. `hosts.label`: the hostname the
host last reported with, shown beside the id. `hosts.consumer_seen`: when a Dramatiq worker
process consuming `ckpt.host.<id>` last said it runs; a restore is routed only to a host with a
live consumer. Existing data: each host's label is its name (the hostname it was recorded
under); no consumer has reported yet (NULL).

Revision ID: 0012
Revises: 0010
Create Date: 2026-11-27 10:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0010"  # set to the revision merged before this one (0011) at merge
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("label", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("consumer_seen", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE hosts SET label = name")


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("consumer_seen")
        batch_op.drop_column("label")
