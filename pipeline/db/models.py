"""The control plane's tables: checkpoints, their files and shard manifest, the content
the shards reference and its copies on storage workers, jobs and the job timeline.

Content is the unit of storage (docs/design.md, section 3): a content (SHA-256, size) has at
most one copy per storage worker, and every shard of every checkpoint with that SHA-256
references it, so every checkpoint sharing it sees the same truth about its copies.

The database is the single source of truth (docs/design.md, invariant 3). Alembic
owns the schema: every change here needs a new revision under ``migrations/versions``.

The annotations are evaluated as the classes are declared (no ``from __future__ import
annotations``; a class declared further down is named in quotes): declarative mapping reads
every ``Mapped[...]``, and a string annotation is compiled and evaluated for that, once per
column at every start of every command.
"""
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
    text,
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


class PartialIndex(Index):
    """An index of only the rows that match ``where``, on SQLite and PostgreSQL alike: what
    ``Index(..., sqlite_where=text(where), postgresql_where=text(where))`` declares, the same DDL
    on both (the revisions create these indexes so: migrations/versions/0004, 0014, 0019).

    The difference: each backend's ``where`` is filled in when that backend first reads its
    options (its DDL compiler, Alembic's comparison), not when the class is declared. SQLAlchemy
    validates a ``postgresql_*`` keyword at once by importing its PostgreSQL dialect, and every
    command imports the models: on a SQLite control plane that was 25 ms of CPU of each
    ``ckpt status`` spent on a dialect it never uses (docs/design.md, "Start-up")."""

    #: The backends whose DDL carries the ``WHERE``.
    BACKENDS = ("sqlite", "postgresql")

    def __init__(self, name: str, *columns: str, where: str, unique: bool = False) -> None:
        self.where = where
        super().__init__(name, *columns, unique=unique)

    def _kw_reg_for_dialect_cls(self, dialect_name: str) -> Any:  # type: ignore[override]
        # SQLAlchemy builds ``dialect_options[dialect_name]`` (this index's options for one
        # backend: its defaults, then what was passed) with this on that backend's first read.
        options = super()._kw_reg_for_dialect_cls(dialect_name)
        if dialect_name in self.BACKENDS:
            options["where"] = text(self.where)
        return options

    @property
    def dialect_kwargs(self) -> Any:
        # The flat ``<backend>_<option>`` view lists only the backends read so far: what copies an
        # index (``Table.to_metadata``) or renders one (Alembic's autogenerate) reads it, and
        # without both backends read first the copy or the revision has no WHERE (a full unique
        # index). Nothing a command runs reads it: they do not import the PostgreSQL dialect.
        for backend in self.BACKENDS:
            self.dialect_options[backend]
        return super().dialect_kwargs


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
        # A path names a checkpoint on one host: two hosts may write the same path.
        UniqueConstraint("host", "path", "version", name="uq_checkpoints_host_path_version"),
        Index("ix_checkpoints_run_current", "run", "current"),
        # A run's newest checkpoints (status, the runs view: pipeline.core.retention.recency)
        # without sorting the run.
        Index("ix_checkpoints_run_recent", "run", "current", "mtime", "id"),
        # Counts and bytes by run and state (the overview, /metrics) from the index alone.
        Index("ix_checkpoints_run_state", "run", "current", "store_state", "local_present", "total_bytes"),
        # The few checkpoints changed on disk (status, the runs view), per run: a partial index
        # holds only them (migrations/versions/0019).
        PartialIndex("ix_checkpoints_disk_changed", "run", "current", where="disk_changed_at IS NOT NULL"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(4096), index=True)
    #: The training host whose disk holds its local files (Settings.host_id of the watcher or
    #: the process that recorded it); NULL for checkpoints recorded before hosts were (any host).
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    run: Mapped[str] = mapped_column(String(4096), index=True)
    name: Mapped[str] = mapped_column(String(1024))
    is_dir: Mapped[bool] = mapped_column(Boolean)
    #: SHA-256 over the sorted (relative path, size, file SHA-256) of every file.
    version: Mapped[str] = mapped_column(String(64), index=True)
    step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    #: When its content was complete: its newest file's modification time, refreshed when the
    #: same content is saved again. What "newest" reads first (pipeline.core.retention.recency).
    mtime: Mapped[float] = mapped_column(Float)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    local_present: Mapped[bool] = mapped_column(Boolean, default=True)
    #: Why its local copy is gone (``local_present`` false), from the code that saw it go:
    #: "rotated" (our rotation deleted it, RF verified copies remaining), "deleted" (the watcher
    #: found it gone: the trainer's own rotation, a person, a move), "replaced" (new content at its
    #: path superseded it). None while it is present, or when nothing recorded why.
    local_gone: Mapped[str | None] = mapped_column(String(16), nullable=True)
    detected_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    #: The newest version recorded at its path: what `ckpt status`, "latest" and a restore
    #: by path mean. Older versions are superseded (their store job says so).
    current: Mapped[bool] = mapped_column(Boolean, default=True, server_default="1")
    #: The layout detection recognised (pipeline.core.layouts): "hf-trainer", "torch-dcp", "file"...
    layout: Mapped[str | None] = mapped_column(String(32), nullable=True)
    #: What proved it complete: "structure" (its layout and files), "quiet" (no change for the
    #: root's quiet period), "declared" (the writer said so: pipeline.protect).
    completed_by: Mapped[str | None] = mapped_column(String(16), nullable=True)
    #: When it stopped holding its content (superseded, vanished or forgotten): from then on its
    #: shards no longer keep their content from garbage collection.
    released_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True, index=True)
    #: A pinned checkpoint is never forgotten by the remote retention policy.
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")
    pin_note: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Numbers the trainer logged for its step (trainer_state.json): what "keep the best K" reads.
    metrics: Mapped[dict[str, float] | None] = mapped_column(JSON, nullable=True)
    #: The state of its newest store job, for what is shown and counted (docs/design.md, "the
    #: checkpoint's state"): written only by create_job() and transition(), in the transaction
    #: that changes the job. Decisions that delete or release read the job itself.
    store_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    #: When the files at its path stopped matching this (current) version while the new
    #: content is not recorded yet, and what changed (pipeline.detection.ondisk): shown loudly
    #: as "changed on disk, not protected"; a restore by path refuses it. None: they match.
    disk_changed_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    disk_changed: Mapped[str | None] = mapped_column(Text, nullable=True)

    files: Mapped[list["CheckpointFile"]] = relationship(
        back_populates="checkpoint", order_by="CheckpointFile.relpath", cascade="all, delete-orphan"
    )


class RunStateCount(Base):
    """How many of a run's current checkpoints are in one state, with or without their local
    copy, and their bytes: what the overview, ``/metrics`` and ``ckpt status`` count, read
    without grouping the checkpoints. Kept by triggers on ``checkpoints`` in the transaction
    of every change (migrations/versions/0016); never written by the code."""

    __tablename__ = "run_state_counts"

    run: Mapped[str] = mapped_column(String(4096), primary_key=True)
    store_state: Mapped[str] = mapped_column(String(16), primary_key=True)
    local_present: Mapped[bool] = mapped_column(Boolean, primary_key=True)
    checkpoints: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)


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
    #: The host whose disk holds this file when it is not the checkpoint's own (a part another
    #: rank's host wrote: docs/design.md, "One checkpoint, several hosts"); NULL: the checkpoint's.
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)

    checkpoint: Mapped[Checkpoint] = relationship(back_populates="files")
    shards: Mapped[list["Shard"]] = relationship(
        back_populates="file", order_by="Shard.seq", cascade="all, delete-orphan"
    )


class CheckpointPart(Base):
    """Files one host holds of a checkpoint another host records: a torch DCP rank's ``.distcp``
    files at the path where the coordinator's host writes ``.metadata``.

    The part's host announces it (hashed and planned, as detection does for a checkpoint);
    the coordinator's host records the checkpoint once the parts cover every file its
    ``.metadata`` names, and claims them (``checkpoint_id``). docs/design.md, "One checkpoint,
    several hosts".
    """

    __tablename__ = "checkpoint_parts"
    __table_args__ = (UniqueConstraint("host", "path", name="uq_checkpoint_parts_host_path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    path: Mapped[str] = mapped_column(String(4096), index=True)
    run: Mapped[str] = mapped_column(String(4096), index=True)
    #: Per file: relpath, size, mtime_ns, sha256, format, facts_format and its shard rows.
    files: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    #: SHA-256 over its (relpath, size, file SHA-256): changes when the host writes new bytes there.
    version: Mapped[str] = mapped_column(String(64))
    #: The checkpoint recorded with these files, once the coordinator's host claimed them.
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id", ondelete="SET NULL"),
                                                      nullable=True, index=True)
    local_present: Mapped[bool] = mapped_column(Boolean, default=True)
    announced_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


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
    sha256: Mapped[str] = mapped_column(ForeignKey("contents.sha256"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    src_offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(BigInteger)
    payload_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Names of the tensors held (safetensors shards), for inspection.
    tensors: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)

    file: Mapped[CheckpointFile] = relationship(back_populates="shards")
    content: Mapped["Content"] = relationship()


class Content(Base):
    """A content object: bytes with one SHA-256, stored as copies on workers, referenced by shards."""

    __tablename__ = "contents"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    #: "live", "condemned" (garbage collection decided to delete it: no copy counts) or
    #: "deleted" (every copy is gone); see pipeline.states.ContentState.
    state: Mapped[str] = mapped_column(String(16), default="live", server_default="live", index=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    #: Last time a checkpoint referenced it or stopped referencing it: garbage collection
    #: waits a grace period after that.
    last_referenced_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    condemned_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)

    copies: Mapped[list["ContentCopy"]] = relationship(back_populates="content", cascade="all, delete-orphan")


class StorageWorker(Base):
    """A storage worker daemon, however it was found."""

    __tablename__ = "storage_workers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(1024))
    zone: Mapped[str] = mapped_column(String(128), default="")
    #: "local" (started by ckpt up), "static" (CKPT_WORKERS), "mdns", or "target" (a
    #: ``[[targets]]`` object store: its url is ``s3://bucket/prefix``).
    source: Mapped[str] = mapped_column(String(16))
    #: pipeline.states.Tier: "workers" (a storage worker: its copies count toward RF) or
    #: "objectstore" (an S3 bucket: its copies are counted by the tier policy).
    tier: Mapped[str] = mapped_column(String(16), default="workers", server_default="workers")
    #: pipeline.states.WorkerState: "up", "full" (above the high watermark: keeps serving and
    #: counting, receives nothing new), "down", "candidate", "rejected", "draining", "removable".
    state: Mapped[str] = mapped_column(String(16), default="up")
    capacity_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    free_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Bytes its shards take (the worker's own count).
    used_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    #: The filesystem its shards are on, as it reports it (boot id of its kernel, st_dev,
    #: statvfs f_fsid): workers on one disk count its capacity once (pipeline/capacity.py).
    #: None: it did not say (an older worker), counted alone.
    filesystem: Mapped[str | None] = mapped_column(String(255), nullable=True)
    #: That filesystem's own size and free bytes (its capacity_bytes may be a share of it).
    fs_capacity_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    fs_free_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    last_seen: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)


def _content_size(context: Any) -> int:
    """A new copy's ``size``: its content's (which never changes), when the code making the row
    does not say it."""
    sha = context.get_current_parameters()["sha256"]
    return int(context.connection.scalar(text("SELECT size FROM contents WHERE sha256 = :sha"), {"sha": sha}) or 0)


class ContentCopy(Base):
    """One content's copy on one storage worker (at most one per pair)."""

    __tablename__ = "copies"
    __table_args__ = (
        UniqueConstraint("sha256", "worker_id", name="uq_copies_sha256_worker"),
        # A worker's copies in a state; with their bytes, the bytes each worker holds (the
        # overview, /metrics, status) from the index alone (migrations/versions/0020).
        Index("ix_copies_worker_state_size", "worker_id", "state", "size"),
        # A worker's copies in hash order: the scrub's and the reconcile's pages.
        Index("ix_copies_worker_sha256", "worker_id", "sha256"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sha256: Mapped[str] = mapped_column(ForeignKey("contents.sha256", ondelete="CASCADE"), index=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("storage_workers.id"))
    #: Its content's size, copied when the row is made (a content's size never changes): what a
    #: worker holds is summed from the copies alone, without looking up each content.
    size: Mapped[int] = mapped_column(BigInteger, default=_content_size, server_default="0")
    #: pipeline.states.CopyState: "pending", "stored", "verified", "corrupt", "missing",
    #: "abandoned", "trimmed" or "deleting".
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    stored_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: Last time the worker's re-hash matched the content's SHA-256.
    verified_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: Last time the copy was checked (verify or scrub), whatever the result.
    checked_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: On an object store: the ``ChecksumSHA256`` the store keeps for the object (the SHA-256
    #: itself for one PUT; the composite ``<base64>-<parts>`` of a multipart upload), which
    #: confirming the copy compares. None on a storage worker.
    checksum: Mapped[str | None] = mapped_column(String(96), nullable=True)
    #: The key (Dramatiq message id) of the last replicate message sent for it, and when: a
    #: delivery with another key is stale and dropped (pipeline/deliveries.py).
    sent_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sent_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)

    content: Mapped[Content] = relationship(back_populates="copies")
    worker: Mapped[StorageWorker] = relationship()


class Job(Base):
    """A unit of durable work: storing or restoring one checkpoint."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_state_lease", "state", "lease_until"),
        # The latest store job of each checkpoint, from the index alone.
        Index("ix_jobs_kind_checkpoint", "kind", "checkpoint_id", "id"),
        # Jobs counted by kind and state (/metrics) from the index alone.
        Index("ix_jobs_kind_state", "kind", "state"),
        # One active repair per content: two repairs of one content would set aside each
        # other's new copy (pipeline.integrity.repair).
        PartialIndex("uq_jobs_active_repair", "sha256", unique=True,
                     where="kind = 'repair' AND state IN ('queued', 'repairing')"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=True, index=True
    )
    #: The content a repair job works on.
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
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
    #: The key (Dramatiq message id) of the last message sent for its step, and when: a
    #: delivery with another key is stale and dropped (pipeline/deliveries.py).
    sent_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sent_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: The queue its next message waits for (no live consumer: its host is down); NULL otherwise.
    waiting_for: Mapped[str | None] = mapped_column(String(255), nullable=True, index=True)

    checkpoint: Mapped[Checkpoint | None] = relationship()
    events: Mapped[list["JobEvent"]] = relationship(order_by="JobEvent.id", cascade="all, delete-orphan")


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
    __table_args__ = (UniqueConstraint("host", "path", name="uq_detection_problems_host_path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: The host whose watcher found it ("" for problems found before hosts were).
    host: Mapped[str] = mapped_column(String(255), default="", server_default="")
    path: Mapped[str] = mapped_column(String(4096))
    run: Mapped[str] = mapped_column(String(4096), index=True)
    reason: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class DetectionWait(Base):
    """An entry the watcher sees but does not record yet: its writer may still be at work (an
    incomplete layout) or it waits out the root's quiet period. Shown with the time left; kept
    so that how long it has waited survives a watcher's restart (docs/design.md, section 2)."""

    __tablename__ = "detection_waits"
    __table_args__ = (UniqueConstraint("host", "path", name="uq_detection_waits_host_path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255), default="", server_default="")
    path: Mapped[str] = mapped_column(String(4096))
    run: Mapped[str] = mapped_column(String(4096), index=True)
    #: Why it is not recorded yet (the layout's words), as when its files last changed.
    reason: Mapped[str] = mapped_column(Text)
    #: The newest modification time of its files (ns): the same value after a restart means
    #: nothing changed meanwhile, so ``since`` goes on.
    newest_ns: Mapped[int] = mapped_column(BigInteger)
    #: Since when nothing in it changed (its files' newest change, as the watcher first saw it).
    since: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    #: When the quiet period ends and it is recorded if nothing changes (a layout we cannot
    #: judge); None: it waits for its writer's last file.
    ready_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)


class TrainingHost(Base):
    """A training host, as its watcher and its Dramatiq workers last reported in: a checkpoint
    whose local steps wait for a host that has gone silent says so, and a restore goes only to a
    host whose queue something consumes (docs/design.md, "Hosts"; pipeline/db/hosts.py)."""

    __tablename__ = "hosts"

    #: The host id (pipeline/hostid.py): what checkpoints.host and the queue ckpt.host.<id> name.
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    last_seen: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)
    #: Its hostname when it last reported in: shown beside the id, never a key.
    label: Mapped[str | None] = mapped_column(String(255))


class QueueConsumer(Base):
    """A queue some Dramatiq worker process consumes, as it last said so (its heartbeat):
    a queue whose consumer went silent belongs to a host that is down (pipeline/consumers.py)."""

    __tablename__ = "queue_consumers"

    queue: Mapped[str] = mapped_column(String(255), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    seen_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class CapacitySample(Base):
    """The cluster's usage at one time (the scheduler samples it): what "days until full"
    and the usage chart are computed from."""

    __tablename__ = "capacity_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow, index=True)
    #: bytes the storage workers' disks hold (their own report), and their capacity
    used_bytes: Mapped[int] = mapped_column(BigInteger)
    capacity_bytes: Mapped[int] = mapped_column(BigInteger)
    #: bytes of the copies the control plane knows (content size x sent copies)
    stored_bytes: Mapped[int] = mapped_column(BigInteger)


class ControlPlane(Base):
    """This control plane's identity (one row, made by migration 0018): it owns the bucket
    prefixes it uses (``<prefix>/.ckpt-home``, pipeline/objectstore/tier.py)."""

    __tablename__ = "control_plane"

    #: Always "this": the table holds one row.
    name: Mapped[str] = mapped_column(String(16), primary_key=True, default="this")
    id: Mapped[str] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utcnow)


class Lock(Base):
    """A named lease held by one process (the scheduler's leader lock)."""

    __tablename__ = "locks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime())


class Alert(Base):
    """One occurrence of an alert condition (pipeline/alerts.py), from the first evaluation that
    found it until it has not been found for ``alert_clear_seconds``: the banner shows the active
    ones that fired, the incidents page their history. A condition that clears before its
    threshold leaves no row."""

    __tablename__ = "alerts"
    __table_args__ = (
        # At most one open occurrence of a condition.
        PartialIndex("uq_alerts_open_key", "key", unique=True, where="resolved_at IS NULL"),
        Index("ix_alerts_since", "since"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    #: ``<alert>:<hash of subject>``: names one condition (pipeline.alerts.key_of).
    key: Mapped[str] = mapped_column(String(64))
    #: The condition (pipeline.alerts.KINDS): worker_down, content_lost, ...
    alert: Mapped[str] = mapped_column(String(32))
    #: What it is about: a worker id, a run, "" for the cluster.
    subject: Mapped[str] = mapped_column(Text, default="")
    severity: Mapped[str] = mapped_column(String(16))
    #: What was found, in words (the newest evaluation's).
    summary: Mapped[str] = mapped_column(Text)
    #: The web UI page that shows it (a path such as ``/workers?q=w-1``).
    link: Mapped[str] = mapped_column(Text, default="/")
    #: Since when the condition holds (its own evidence where there is some, else the first
    #: evaluation that found it).
    since: Mapped[datetime] = mapped_column(UtcDateTime())
    #: When it had held longer than its threshold and fired (None: not yet).
    fired_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: The newest evaluation that found it.
    last_seen: Mapped[datetime] = mapped_column(UtcDateTime())
    #: The first evaluation that no longer found it, while it is kept open for
    #: ``alert_clear_seconds`` (None: it holds). Found again meanwhile, it is the same occurrence.
    cleared_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: What it was about at its newest evaluation, for the resolution to say what became of
    #: each: the workers of a full disk, the ids of lost checkpoints, the under-replicated
    #: contents (at most :data:`pipeline.alerts.EVIDENCE`). None: nothing recorded.
    evidence: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    resolved_at: Mapped[datetime | None] = mapped_column(UtcDateTime(), nullable=True)
    #: The job that repaired it, when one did (a repair, a reconcile, a scrub, a store).
    resolved_by: Mapped[int | None] = mapped_column(Integer, nullable=True)
    resolution: Mapped[str | None] = mapped_column(Text, nullable=True)
