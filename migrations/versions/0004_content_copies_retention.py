"""content is the unit of storage: contents and copies replace per-shard replicas

A content (SHA-256, size) has at most one copy per storage worker; shards reference it.
Existing data: one content per distinct shard hash; one copy per (hash, worker) merged from
the replica rows of every shard with that hash (a damaged row wins: the file is what it is;
else the newest verification; else stored, pending, then the retired states). Checkpoints
whose latest store job ended superseded or vanished are released (their content becomes
garbage once nothing kept references it). New: pins, logged metrics, workers' used bytes,
samples of the cluster's usage.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 20:00:00
"""
from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

#: How replica rows of one (content, worker) merge into its copy: the first state any row has.
_MERGE_ORDER = ("corrupt", "missing", "verified", "stored", "pending", "abandoned", "trimmed")


def upgrade() -> None:
    now = datetime.now(UTC)
    op.create_table(
        "contents",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), server_default="live", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_referenced_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("condemned_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_contents")),
    )
    with op.batch_alter_table("contents", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_contents_state"), ["state"], unique=False)
    op.create_table(
        "copies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["sha256"], ["contents.sha256"], name=op.f("fk_copies_sha256_contents"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_id"], ["storage_workers.id"], name=op.f("fk_copies_worker_id_storage_workers")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_copies")),
        sa.UniqueConstraint("sha256", "worker_id", name="uq_copies_sha256_worker"),
    )
    with op.batch_alter_table("copies", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_copies_sha256"), ["sha256"], unique=False)
        batch_op.create_index("ix_copies_worker_state", ["worker_id", "state"], unique=False)
        batch_op.create_index("ix_copies_worker_sha256", ["worker_id", "sha256"], unique=False)

    op.create_table(
        "capacity_samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_bytes", sa.BigInteger(), nullable=False),
        sa.Column("capacity_bytes", sa.BigInteger(), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_capacity_samples")),
    )
    with op.batch_alter_table("capacity_samples", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_capacity_samples_at"), ["at"], unique=False)

    conn = op.get_bind()
    shards = list(conn.execute(sa.text("SELECT sha256, max(size) FROM shards GROUP BY sha256")))
    if shards:
        conn.execute(sa.text("INSERT INTO contents (sha256, size, state, created_at, last_referenced_at) "
                             "VALUES (:sha, :size, 'live', :now, :now)"),
                     [{"sha": sha, "size": size, "now": now} for sha, size in shards])
    merged: dict[tuple[str, str], dict] = {}
    for sha, worker, state, attempts, stored, verified, checked, error in conn.execute(sa.text(
            "SELECT s.sha256, r.worker_id, r.state, r.attempts, r.stored_at, r.verified_at, r.checked_at,"
            " r.last_error FROM replicas r JOIN shards s ON s.id = r.shard_id ORDER BY r.id")):
        row = {"sha": sha, "worker": worker, "state": state, "attempts": attempts, "stored": stored,
               "verified": verified, "checked": checked, "error": error}
        have = merged.get((sha, worker))
        rank = _MERGE_ORDER.index(state) if state in _MERGE_ORDER else len(_MERGE_ORDER)
        if have is None or rank < _MERGE_ORDER.index(have["state"]) or (
                state == have["state"] == "verified" and str(verified or "") > str(have["verified"] or "")):
            merged[(sha, worker)] = row
    if merged:
        conn.execute(sa.text(
            "INSERT INTO copies (sha256, worker_id, state, attempts, stored_at, verified_at, checked_at, last_error)"
            " VALUES (:sha, :worker, :state, :attempts, :stored, :verified, :checked, :error)"), list(merged.values()))

    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.create_foreign_key(batch_op.f("fk_shards_sha256_contents"), "contents", ["sha256"], ["sha256"])
    with op.batch_alter_table("replicas", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_replicas_shard_id"))
        batch_op.drop_index(batch_op.f("ix_replicas_worker_id"))
    op.drop_table("replicas")

    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("released_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("pinned", sa.Boolean(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("pin_note", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("metrics", sa.JSON(), nullable=True))
        batch_op.create_index(batch_op.f("ix_checkpoints_released_at"), ["released_at"], unique=False)
    conn.execute(sa.text(
        "UPDATE checkpoints SET released_at = :now WHERE id IN ("
        " SELECT j.checkpoint_id FROM jobs j WHERE j.kind = 'store' AND j.state IN ('superseded', 'vanished')"
        " AND j.id = (SELECT max(j2.id) FROM jobs j2 WHERE j2.kind = 'store' AND j2.checkpoint_id = j.checkpoint_id))"),
        {"now": now})
    with op.batch_alter_table("storage_workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("used_bytes", sa.BigInteger(), server_default="0", nullable=False))
    # Repairs are per content now: a repair job names its content, one active per content.
    active = "kind = 'repair' AND state IN ('queued', 'repairing')"
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sha256", sa.String(length=64), nullable=True))
    # Repair jobs of the old kind (per checkpoint) that are still queued or running end: the
    # scheduler's next sweep asks for the per-content repairs they stood for.
    conn.execute(sa.text("UPDATE jobs SET state = 'failed', last_error = 'replaced by per-content repairs'"
                         " WHERE kind = 'repair' AND state IN ('queued', 'repairing')"))
    op.create_index("uq_jobs_active_repair", "jobs", ["sha256"], unique=True, sqlite_where=sa.text(active),
                    postgresql_where=sa.text(active))
    # The latest store job of each checkpoint (every list and status view asks it) from the index alone.
    op.create_index("ix_jobs_kind_checkpoint", "jobs", ["kind", "checkpoint_id", "id"])
    op.create_index("ix_checkpoints_run_step", "checkpoints", ["run", "current", "step", "id"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_run_step", table_name="checkpoints")
    op.drop_index("ix_jobs_kind_checkpoint", table_name="jobs")
    with op.batch_alter_table("capacity_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_capacity_samples_at"))
    op.drop_table("capacity_samples")
    op.drop_index("uq_jobs_active_repair", table_name="jobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("sha256")
    with op.batch_alter_table("storage_workers", schema=None) as batch_op:
        batch_op.drop_column("used_bytes")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_released_at"))
        batch_op.drop_column("metrics")
        batch_op.drop_column("pin_note")
        batch_op.drop_column("pinned")
        batch_op.drop_column("released_at")
    op.create_table(
        "replicas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("shard_id", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["shard_id"], ["shards.id"], name=op.f("fk_replicas_shard_id_shards"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_id"], ["storage_workers.id"],
                                name=op.f("fk_replicas_worker_id_storage_workers")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
        sa.UniqueConstraint("shard_id", "worker_id", name="uq_replicas_shard_worker"),
    )
    with op.batch_alter_table("replicas", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_replicas_shard_id"), ["shard_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_replicas_worker_id"), ["worker_id"], unique=False)
    # Every shard gets a replica row per copy of its content (DELETING copies had no replica form).
    op.execute(sa.text(
        "INSERT INTO replicas (shard_id, worker_id, state, attempts, stored_at, verified_at, last_error, checked_at)"
        " SELECT s.id, c.worker_id, c.state, c.attempts, c.stored_at, c.verified_at, c.last_error, c.checked_at"
        " FROM shards s JOIN copies c ON c.sha256 = s.sha256 WHERE c.state <> 'deleting'"))
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_shards_sha256_contents"), type_="foreignkey")
    with op.batch_alter_table("copies", schema=None) as batch_op:
        batch_op.drop_index("ix_copies_worker_sha256")
        batch_op.drop_index("ix_copies_worker_state")
        batch_op.drop_index(batch_op.f("ix_copies_sha256"))
    op.drop_table("copies")
    with op.batch_alter_table("contents", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_contents_state"))
    op.drop_table("contents")
