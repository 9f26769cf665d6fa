"""object-store tier: storage rows say their tier, copies on a bucket keep the store's checksum

An object store (a ``[[targets]]`` bucket, pipeline/objectstore/) is a row of
``storage_workers`` like a storage worker, so its copies are rows of ``copies`` moved by the one
mover under the one good-copy rule. ``storage_workers.tier`` says which kind a row is:
``workers`` (a storage worker daemon: its copies count toward RF) or ``objectstore`` (counted by
the tier policy, ``target_copies`` / ``target_mode``). ``copies.checksum`` holds the
``ChecksumSHA256`` the store keeps for a copy's object (the SHA-256 for one PUT, the composite
of the part digests for a multipart upload), which confirming the copy compares.

Existing data: every row is a storage worker (``workers``); no copy has a checksum.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 00:45:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (no batch rebuild): SQLite keeps the tables' indexes and triggers.
    op.add_column("storage_workers", sa.Column("tier", sa.String(16), nullable=False, server_default="workers"))
    op.add_column("copies", sa.Column("checksum", sa.String(96), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("copies") as batch:
        batch.drop_column("checksum")
    with op.batch_alter_table("storage_workers") as batch:
        batch.drop_column("tier")
