"""The control plane's tables: checkpoints, their files and shard manifest, storage
workers, replicas, jobs and the job timeline.

The database is the single source of truth (docs/design.md, invariant 3). Alembic
owns the schema: every change here needs a new revision under ``migrations/versions``.
"""
from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class UtcDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite hands back naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Checkpoint(Base):
    """One version of one checkpoint: a file or a directory under a run."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("path", "version", name="uq_checkpoints_path_version"),
        Index("ix_checkpoints_run_current", "run", "current"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(4096), index=True)
    run: Mapped[str] = mapped_column(String(4096), index=True)
    name: Mapped[str] = mapped_column(String(1024))
    is_dir: Mapped[bool] = mapped_column(Boolean)
    #: SHA-256 over the sorted (relative path, size, file SHA-256) of every file.
    version: Mapped[str] = mapped_column(String(64))
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    mtime: Mapped[float] = mapped_column(Float)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    local_present: Mapped[bool] = mapped_column(Boolean, default=True)
    detected_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    #: The newest version recorded at its path: what `ckpt status`, "latest" and a restore
    #: by path mean. Older versions are superseded (their store job says so).
    current: Mapped[bool] = mapped_column(Boolean, default=True, server_default="1")
    #: The layout detection recognised (pipeline.core.layouts): "hf-trainer", "torch-dcp", "file"...
    layout: Mapped[str | None] = mapped_column(String(32), nullable=True)
    #: What proved it complete: "structure" (its layout and files), "quiet" (no change for the
    #: root's quiet period), "declared" (the writer said so: pipeline.protect).
    completed_by: Mapped[str | None] = mapped_column(String(16), nullable=True)

    files: Mapped[list[CheckpointFile]] = relationship(
        back_populates="checkpoint", order_by="CheckpointFile.relpath", cascade="all, delete-orphan"
    )


class CheckpointFile(Base):
    """One file of a checkpoint, with its size and whole-file SHA-256 at detection."""

    __tablename__ = "checkpoint_files"
    __table_args__ = (UniqueConstraint("checkpoint_id", "relpath", name="uq_checkpoint_files_relpath"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)
    #: Path relative to the checkpoint ("" when the checkpoint is a single file).
    relpath: Mapped[str] = mapped_column(String(4096))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    #: "safetensors" or "opaque".
    format: Mapped[str] = mapped_column(String(16))
    mtime_ns: Mapped[int] = mapped_column(BigInteger)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="files")
    shards: Mapped[list[Shard]] = relationship(
        back_populates="file", order_by="Shard.seq", cascade="all, delete-orphan"
    )


class Shard(Base):
    """One entry of the manifest: a content-addressed piece of one file.

    The shard's bytes on a worker are ``payload_offset`` bytes of its own header (zero
    for raw chunks) followed by ``length`` bytes copied from ``src_offset`` of the file.
    """

    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("file_id", "seq", name="uq_shards_file_seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    file_id: Mapped[int] = mapped_column(ForeignKey("checkpoint_files.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    #: "raw" (a byte range) or "safetensors" (a valid safetensors file of whole tensors).
    kind: Mapped[str] = mapped_column(String(16))
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    src_offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(BigInteger)
    payload_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Names of the tensors held (safetensors shards), for inspection.
    tensors: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)

    file: Mapped[CheckpointFile] = relationship(back_populates="shards")
    replicas: Mapped[list[Replica]] = relationship(back_populates="shard", cascade="all, delete-orphan")


class StorageWorker(Base):
    """A storage worker daemon, however it was found."""

    __tablename__ = "storage_workers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(1024))
    zone: Mapped[str] = mapped_column(String(128), default="")
    #: "local" (started by ckpt up), "static" (CKPT_WORKERS) or "mdns".
    source: Mapped[str] = mapped_column(String(16))
    #: "up", "down", "candidate" (found, not yet admitted), "rejected" (failed the key
    #: challenge), "draining" (copying its shards away) or "removable" (drained).
    state: Mapped[str] = mapped_column(String(16), default="up")
    capacity_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    free_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    last_seen: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Replica(Base):
    """One shard on one storage worker."""

    __tablename__ = "replicas"
    __table_args__ = (UniqueConstraint("shard_id", "worker_id", name="uq_replicas_shard_worker"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"), index=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("storage_workers.id"), index=True)
    #: "pending", "stored", "verified", "corrupt", "missing", "abandoned" or "trimmed".
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    stored_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: Last time the worker's re-hash matched the manifest.
    verified_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: Last time the replica was checked (verify or scrub), whatever the result.
    checked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)

    shard: Mapped[Shard] = relationship(back_populates="replicas")
    worker: Mapped[StorageWorker] = relationship()


class Job(Base):
    """A unit of durable work: storing or restoring one checkpoint."""

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_state_lease", "state", "lease_until"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), index=True)
    checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=True, index=True
    )
    state: Mapped[str] = mapped_column(String(16))
    #: Executions of the current step (crash redeliveries included).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Why a verified checkpoint still has its local copy, when rotation wants it gone.
    blocked_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    #: Collapses duplicates: at most one job per key (e.g. one nightly scrub per worker and day).
    dedupe_key: Mapped[str | None] = mapped_column(String(255), nullable=True, unique=True)
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_total: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)

    checkpoint: Mapped[Checkpoint | None] = relationship()
    events: Mapped[list[JobEvent]] = relationship(order_by="JobEvent.id", cascade="all, delete-orphan")


class JobEvent(Base):
    """One row of a job's timeline: a transition (or a note) with its time and detail."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)


class DetectionProblem(Base):
    """An entry of a run that detection cannot protect as it is, reported once (status, UI,
    metrics) until it is fixed or goes away."""

    __tablename__ = "detection_problems"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(4096), unique=True)
    run: Mapped[str] = mapped_column(String(4096), index=True)
    reason: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Lock(Base):
    """A named lease held by one process (the scheduler's leader lock)."""

    __tablename__ = "locks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())
