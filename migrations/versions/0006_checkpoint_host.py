"""each checkpoint records the training host that holds its local files

`checkpoints.host`: the host whose disk holds the checkpoint's local files. Steps that touch
local files run on that host's own queue, and a path names a checkpoint on one host (the
unique constraint becomes host, path, version). Existing data: NULL, "recorded before hosts"
(any host, as before): which host wrote an old row cannot be known from the database.
New: `hosts`, when each training host's watcher last reported in.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 02:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host", sa.String(length=255), nullable=True))
        batch_op.drop_constraint("uq_checkpoints_path_version", type_="unique")
        batch_op.create_unique_constraint("uq_checkpoints_host_path_version", ["host", "path", "version"])


def downgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_constraint("uq_checkpoints_host_path_version", type_="unique")
        batch_op.create_unique_constraint("uq_checkpoints_path_version", ["path", "version"])
        batch_op.drop_column("host")
    op.drop_table("hosts")
