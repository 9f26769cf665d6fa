"""states that mean what they say: why a local copy is gone, each worker's filesystem, waiting entries

- `checkpoints.local_gone`: why the local copy is gone ("rotated" by our rotation, "deleted"
  outside it: the trainer's own rotation or a person, "replaced" by new content at the path).
  Existing data, from the evidence each checkpoint's store jobs left: the last of the timeline rows
  our rotation writes ("local copy removed ...") and those the watcher writes when it finds a local
  copy gone ("... local copy vanished from ..."); where the history was compacted, the state says
  it (rotated: rotated; vanished: deleted; superseded: replaced).
- `storage_workers.filesystem`, `fs_capacity_bytes`, `fs_free_bytes`: the filesystem a worker's
  shards are on, as its status reports it (filled by the next probe), so that workers sharing a
  disk count it once.
- `detection_waits`: the entries the watcher sees but does not record yet, with since when nothing
  in them changed (kept across a watcher's restart).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25 19:00:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

#: What the watcher and rotation wrote in a store job's timeline when a local copy went.
ROTATED_EVENT = "local copy removed%"
DELETED_EVENT = "%local copy vanished from%"


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch:
        batch.add_column(sa.Column("local_gone", sa.String(length=16), nullable=True))
    with op.batch_alter_table("storage_workers", schema=None) as batch:
        batch.add_column(sa.Column("filesystem", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("fs_capacity_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("fs_free_bytes", sa.BigInteger(), nullable=True))
    op.create_table(
        "detection_waits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), server_default="", nullable=False),
        sa.Column("path", sa.String(length=4096), nullable=False),
        sa.Column("run", sa.String(length=4096), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("newest_ns", sa.BigInteger(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_detection_waits"),
        sa.UniqueConstraint("host", "path", name="uq_detection_waits_host_path"),
    )
    op.create_index("ix_detection_waits_run", "detection_waits", ["run"])
    _fill_local_gone()


def _fill_local_gone() -> None:
    conn = op.get_bind()
    gone: dict[int, str] = {}
    # The last event of either kind wins (a copy restored after its rotation, then deleted).
    for cid, detail in conn.execute(sa.text(
            "SELECT j.checkpoint_id, e.detail FROM job_events e JOIN jobs j ON j.id = e.job_id"
            " JOIN checkpoints c ON c.id = j.checkpoint_id"
            " WHERE j.kind = 'store' AND c.local_present = :no AND (e.detail LIKE :rot OR e.detail LIKE :del)"
            " ORDER BY e.id"), {"no": False, "rot": ROTATED_EVENT, "del": DELETED_EVENT}):
        gone[cid] = "rotated" if detail.startswith("local copy removed") else "deleted"
    by_state = {"rotated": "rotated", "vanished": "deleted", "superseded": "replaced"}
    for cid, state in conn.execute(sa.text("SELECT id, store_state FROM checkpoints WHERE local_present = :no"),
                                   {"no": False}):
        if cid not in gone and state in by_state:
            gone[cid] = by_state[state]
    for why in ("rotated", "deleted", "replaced"):
        ids = [cid for cid, w in gone.items() if w == why]
        for i in range(0, len(ids), 500):
            conn.execute(sa.text("UPDATE checkpoints SET local_gone = :why WHERE id IN :ids")
                         .bindparams(sa.bindparam("ids", expanding=True)), {"why": why, "ids": ids[i:i + 500]})


def downgrade() -> None:
    op.drop_index("ix_detection_waits_run", table_name="detection_waits")
    op.drop_table("detection_waits")
    with op.batch_alter_table("storage_workers", schema=None) as batch:
        batch.drop_column("fs_free_bytes")
        batch.drop_column("fs_capacity_bytes")
        batch.drop_column("filesystem")
    with op.batch_alter_table("checkpoints", schema=None) as batch:
        batch.drop_column("local_gone")
