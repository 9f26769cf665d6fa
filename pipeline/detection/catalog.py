"""Recording detected checkpoints in the control plane, and finding them again.

Detection (I/O, outside any transaction) produces a :class:`Detected`: every file is
planned into shards and read once, giving its SHA-256 and its shards'. :func:`record`
turns it into a checkpoint row, its file and shard rows and a ``detected`` store job in
the caller's transaction. The same path and content is recorded once; new content at a
known path supersedes the older version's unfinished job.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.core.planner import ShardPlan, plan
from pipeline.db.models import Checkpoint, CheckpointFile, Job, Shard
from pipeline.db.transitions import create_job, note, transition
from pipeline.detection import completeness, roots
from pipeline.errors import MissingRow, SourceChanged, UnknownCheckpoint
from pipeline.hashing import scan
from pipeline.states import JobKind


@dataclass(frozen=True)
class Detected:
    run: Path
    path: Path
    entries: tuple[completeness.FileEntry, ...]
    shas: tuple[str, ...]
    #: per file, its shard plans with their SHA-256
    shards: tuple[tuple[tuple[ShardPlan, str], ...], ...]

    @property
    def version(self) -> str:
        return version_of((e.relpath, e.size, s) for e, s in zip(self.entries, self.shas, strict=True))

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)


def version_of(files: Iterable[tuple[str, int, str]]) -> str:
    """A checkpoint version: SHA-256 over its sorted (relative path, size, file SHA-256)."""
    h = hashlib.sha256()
    for rel, size, sha in sorted(files):
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


def hash_checkpoint(run: Path, path: Path, entries: list[completeness.FileEntry], *, shard_size: int) -> Detected:
    """Plan every file into shards and hash it and its shards in one read; raise
    :class:`SourceChanged` if a file changed meanwhile."""
    shas, shards = [], []
    for e in entries:
        plans = plan(e.header, e.size, shard_size)
        sha, shard_shas = scan(e.abspath, plans, expected_size=e.size)
        shas.append(sha)
        shards.append(tuple(zip(plans, shard_shas, strict=True)))
    if not completeness.unchanged(entries):
        raise SourceChanged(str(path), "a file changed while it was being hashed")
    return Detected(run=run, path=path, entries=tuple(entries), shas=tuple(shas), shards=tuple(shards))


def signature(entries: Iterable[completeness.FileEntry]) -> tuple[tuple[str, int, int], ...]:
    """What the watcher compares to know a checkpoint did not change: (relpath, size, mtime)."""
    return tuple((e.relpath, e.size, e.mtime_ns) for e in entries)


def record(session: Session, d: Detected, *, lease_seconds: float, detail: str) -> tuple[Checkpoint, Job, bool]:
    """Insert ``d`` with a ``detected`` store job; ``(checkpoint, job, created)``.

    An identical version already recorded is returned as is (``created`` False).
    """
    version = d.version
    existing = session.scalar(select(Checkpoint).where(Checkpoint.path == str(d.path), Checkpoint.version == version))
    if existing is not None:
        job = latest_store_job(session, existing.id)
        if job is None:
            raise MissingRow("jobs", f"the store job of checkpoint {existing.id}")
        if not existing.local_present:
            existing.local_present = True
        return existing, job, False

    # Older versions at the same path: their local copy is now this content.
    for old in session.scalars(
        select(Checkpoint).where(Checkpoint.path == str(d.path), Checkpoint.local_present.is_(True))
    ):
        old.local_present = False
        job = latest_store_job(session, old.id)
        if job is not None and job.state in states.ACTIVE[JobKind.STORE]:
            transition(session, job.id, JobKind.STORE, job.state, states.StoreState.SUPERSEDED,
                       detail=f"new content at {d.path}")

    ckpt = Checkpoint(
        path=str(d.path), run=str(d.run), name=d.path.name, is_dir=d.path.is_dir(), version=version,
        step=roots.step_of(d.path.name), mtime=max(e.mtime_ns for e in d.entries) / 1e9,
        total_bytes=d.total_bytes, local_present=True,
    )
    session.add(ckpt)
    session.flush()
    for e, sha, shards in zip(d.entries, d.shas, d.shards, strict=True):
        f = CheckpointFile(checkpoint_id=ckpt.id, relpath=e.relpath, size=e.size, sha256=sha,
                           format=e.format, mtime_ns=e.mtime_ns)
        f.shards = [Shard(seq=p.seq, kind=p.kind, sha256=shard_sha, size=p.size, src_offset=p.src_offset,
                          length=p.length, payload_offset=p.payload_offset, tensors=list(p.tensors) or None)
                    for p, shard_sha in shards]
        session.add(f)
    job = create_job(session, JobKind.STORE, checkpoint_id=ckpt.id, lease_seconds=lease_seconds,
                     bytes_total=d.total_bytes, detail=detail)
    return ckpt, job, True


def latest_store_job(session: Session, checkpoint_id: int) -> Job | None:
    return session.scalar(
        select(Job).where(Job.checkpoint_id == checkpoint_id, Job.kind == JobKind.STORE)
        .order_by(Job.id.desc()).limit(1)
    )


def resolve(session: Session, ref: str | int) -> Checkpoint:
    """A checkpoint by id, or the newest version recorded at a path."""
    text = str(ref)
    if text.isdigit():
        c = session.get(Checkpoint, int(text))
        if c is not None:
            return c
    c = session.scalar(
        select(Checkpoint).where(Checkpoint.path == str(Path(text).resolve())).order_by(Checkpoint.id.desc()).limit(1)
    )
    if c is None:
        raise UnknownCheckpoint(text)
    return c


def file_path(ckpt: Checkpoint, f: CheckpointFile) -> str:
    return os.path.join(ckpt.path, f.relpath) if f.relpath else ckpt.path


def mark_vanished(session: Session, ckpt: Checkpoint) -> None:
    """The local copy is gone (deleted by hand, or moved): record it on the checkpoint and its job."""
    ckpt.local_present = False
    job = latest_store_job(session, ckpt.id)
    if job is not None:
        note(session, job.id, f"local copy vanished from {ckpt.path}")
