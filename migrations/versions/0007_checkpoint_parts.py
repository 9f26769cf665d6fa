"""one checkpoint made of parts on several hosts; each watcher's problems are its own

`checkpoint_parts`: files a host holds of a checkpoint another host records (a torch DCP
rank's `.distcp` files at the path where the coordinator's host writes `.metadata`).
`checkpoint_files.host`: the host holding a file when it is not the checkpoint's own. Existing
data: NULL, every file on its checkpoint's host, as before.
`detection_problems.host`: the host whose watcher found the problem; the unique path becomes
unique (host, path), since two hosts may have a problem at one path. Existing rows: "" (found
before hosts were); a watcher starting clears only its own host's.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 04:30:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoint_parts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("path", sa.String(length=4096), nullable=False),
        sa.Column("run", sa.String(length=4096), nullable=False),
        sa.Column("files", sa.JSON(), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("local_present", sa.Boolean(), nullable=False),
        sa.Column("announced_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"],
                                name=op.f("fk_checkpoint_parts_checkpoint_id_checkpoints"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_parts")),
        sa.UniqueConstraint("host", "path", name="uq_checkpoint_parts_host_path"),
    )
    with op.batch_alter_table("checkpoint_parts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoint_parts_checkpoint_id"), ["checkpoint_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_checkpoint_parts_path"), ["path"], unique=False)
        batch_op.create_index(batch_op.f("ix_checkpoint_parts_run"), ["run"], unique=False)
    with op.batch_alter_table("checkpoint_files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host", sa.String(length=255), nullable=True))
    with op.batch_alter_table("detection_problems", schema=None) as batch_op:
        batch_op.add_column(sa.Column("host", sa.String(length=255), server_default="", nullable=False))
        batch_op.drop_constraint("uq_detection_problems_path", type_="unique")
        batch_op.create_unique_constraint("uq_detection_problems_host_path", ["host", "path"])


def downgrade() -> None:
    # Two hosts' problems at one path cannot share the old unique path: keep one of each.
    op.execute("DELETE FROM detection_problems WHERE id NOT IN "
               "(SELECT MIN(id) FROM detection_problems GROUP BY path)")
    with op.batch_alter_table("detection_problems", schema=None) as batch_op:
        batch_op.drop_constraint("uq_detection_problems_host_path", type_="unique")
        batch_op.create_unique_constraint("uq_detection_problems_path", ["path"])
        batch_op.drop_column("host")
    with op.batch_alter_table("checkpoint_files", schema=None) as batch_op:
        batch_op.drop_column("host")
    with op.batch_alter_table("checkpoint_parts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoint_parts_run"))
        batch_op.drop_index(batch_op.f("ix_checkpoint_parts_path"))
        batch_op.drop_index(batch_op.f("ix_checkpoint_parts_checkpoint_id"))
    op.drop_table("checkpoint_parts")
