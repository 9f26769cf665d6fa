"""control_plane: the identity of this control plane (one row), which owns its bucket prefixes

An object-store target's prefix holds the content-addressed objects of one control plane: its
collection deletes what its database no longer references, and its copies count on objects it
finds there. Two control planes (two homes' databases) at one prefix would delete each other's
confirmed objects. So each control plane has an identity, a random id made once, and writes it
into every prefix it uses (``<prefix>/.ckpt-home``, pipeline/objectstore/tier.py): a prefix that
names another control plane is refused (its row ``down``, the error saying whose it is).

Existing data: one row with a new random id.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 01:50:00
"""
from __future__ import annotations

import uuid
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "control_plane",
        sa.Column("name", sa.String(16), primary_key=True),  # always "this": one row
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.bulk_insert(table, [{"name": "this", "id": str(uuid.uuid4()), "created_at": datetime.now(UTC)}])


def downgrade() -> None:
    op.drop_table("control_plane")
