"""copies.size: each copy carries its content's size, and the bytes per worker come from an index

What each worker holds (the overview, the workers page, ``/metrics``, ``ckpt status``'s object
stores) and the bytes stored in all (capacity) summed the size of every sent copy's content:
one content looked up per copy row (12,720 lookups at 100k checkpoints, 20-80 ms, every page).
A content's size never changes, so a copy can carry it: ``size`` is written when the row is
made (``pipeline.db.copies.new_copy``; the model's default for any other code), and the index
``(worker_id, state, size)``, which replaces ``(worker_id, state)`` and serves what it did,
answers the sums without reading a table row.

Existing data: each copy's size is its content's.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 08:10:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("copies", sa.Column("size", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute("UPDATE copies SET size = (SELECT contents.size FROM contents WHERE contents.sha256 = copies.sha256)")
    op.create_index("ix_copies_worker_state_size", "copies", ["worker_id", "state", "size"])
    op.drop_index("ix_copies_worker_state", table_name="copies")


def downgrade() -> None:
    op.create_index("ix_copies_worker_state", "copies", ["worker_id", "state"])
    op.drop_index("ix_copies_worker_state_size", table_name="copies")
    with op.batch_alter_table("copies") as batch:
        batch.drop_column("size")
