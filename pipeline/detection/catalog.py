"""Recording detected checkpoints in the control plane, and finding them again.

Detection (I/O, outside any transaction) produces a :class:`Detected`: every file is
planned into shards and hashed, giving its SHA-256 and its shards'. :func:`record`
turns it into a checkpoint row, its file and shard rows and a ``detected`` store job in
the caller's transaction. The same path and content is recorded once; new content at a
known path supersedes the older version's unfinished job.
"""
from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, true
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.core.planner import ShardPlan, plan
from pipeline.db.models import Checkpoint, CheckpointFile, CheckpointPart, Content, Job, Shard
from pipeline.db.transitions import create_job, note, now, transition
from pipeline.detection import completeness, metrics, ondisk, roots
from pipeline.errors import SourceChanged, UnknownCheckpoint
from pipeline.hashing import scan_from_two_places
from pipeline.states import ContentState, JobKind
from pipeline.states import StoreState as S


@dataclass(frozen=True)
class PartFile:
    """A file another host holds of a checkpoint this host records (docs/design.md, "One
    checkpoint, several hosts"): hashed and planned there, announced as a part."""

    host: str
    relpath: str
    size: int
    mtime_ns: int
    sha256: str
    format: str
    #: its shard rows, as that host planned and hashed them (pipeline.detection.parts.shard_rows)
    shards: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Detected:
    run: Path
    path: Path
    entries: tuple[completeness.FileEntry, ...]
    shas: tuple[str, ...]
    #: per file, its shard plans with their SHA-256
    shards: tuple[tuple[tuple[ShardPlan, str], ...], ...]
    #: the layout detection recognised, and what proved the checkpoint complete
    layout: str = ""
    completed_by: str = "structure"
    #: training metrics the checkpoint carries (pipeline.detection.metrics)
    metrics: dict[str, float] | None = None
    #: the step its writer says it saved at (Trainer ``global_step``), else None
    writer_step: int | None = None
    #: files other hosts hold (their parts), and the ids of the parts they come from
    remote: tuple[PartFile, ...] = ()
    parts: tuple[int, ...] = ()

    @property
    def version(self) -> str:
        return version_of([*((e.relpath, e.size, s) for e, s in zip(self.entries, self.shas, strict=True)),
                           *((f.relpath, f.size, f.sha256) for f in self.remote)])

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries) + sum(f.size for f in self.remote)


def version_of(files: Iterable[tuple[str, int, str]]) -> str:
    """A checkpoint version: SHA-256 over its sorted (relative path, size, file SHA-256)."""
    h = hashlib.sha256()
    for rel, size, sha in sorted(files):
        h.update(f"{rel}\0{size}\0{sha}\n".encode())
    return h.hexdigest()


def hash_checkpoint(run: Path, path: Path, entries: list[completeness.FileEntry] | tuple[completeness.FileEntry, ...],
                    *, shard_size: int, layout: str = "", completed_by: str = "structure",
                    on_shard: Callable[[completeness.FileEntry, ShardPlan, str], None] | None = None) -> Detected:
    """Plan every file into shards and hash it and its shards (from its start and its middle at
    once: pipeline.hashing); raise :class:`SourceChanged` if a file changed meanwhile. ``on_shard`` is told each shard's
    SHA-256 as soon as it is known (pipeline.store.early)."""
    shas, shards = [], []
    for e in entries:
        plans = plan(e.header, e.size, shard_size)
        told = None if on_shard is None else functools.partial(on_shard, e)
        sha, shard_shas = scan_from_two_places(e.abspath, plans, expected_size=e.size, on_shard=told)
        shas.append(sha)
        shards.append(tuple(zip(plans, shard_shas, strict=True)))
    if not completeness.unchanged(entries):
        raise SourceChanged(str(path), "a file changed while it was being hashed")
    state = metrics.trainer_state((e.relpath, e.abspath, e.size) for e in entries)
    return Detected(run=run, path=path, entries=tuple(entries), shas=tuple(shas), shards=tuple(shards),
                    layout=layout, completed_by=completed_by,
                    metrics=metrics.from_trainer_state(state) or None, writer_step=metrics.writer_step(state))


#: What the watcher compares to know a checkpoint did not change: (relpath, size, mtime_ns) per file.
Signature = tuple[tuple[str, int, int], ...]


def file_sig(ckpt: Checkpoint) -> Signature:
    """The signature of a recorded version's own files (those on its host)."""
    return tuple((f.relpath, f.size, f.mtime_ns) for f in own_files(ckpt))


def signature(entries: Iterable[completeness.FileEntry]) -> Signature:
    """What the watcher compares to know a checkpoint did not change: (relpath, size, mtime)."""
    return tuple((e.relpath, e.size, e.mtime_ns) for e in entries)


def on_host(host: str | None) -> ColumnElement[bool]:
    """Checkpoints whose local files are on ``host`` (and those recorded before hosts were,
    which belong to any host). ``host`` None: every checkpoint."""
    if host is None:
        return true()
    return or_(Checkpoint.host == host, Checkpoint.host.is_(None))


def file_on_host(host: str | None) -> ColumnElement[bool]:
    """Checkpoint files on ``host``'s disk: its checkpoints' own files and the parts it holds
    of other hosts' checkpoints (join CheckpointFile and Checkpoint). ``host`` None: every file."""
    if host is None:
        return true()
    return or_(CheckpointFile.host == host, and_(CheckpointFile.host.is_(None), on_host(host)))


def own_files(ckpt: Checkpoint) -> list[CheckpointFile]:
    """The files on the checkpoint's own host (not the parts other hosts hold)."""
    return [f for f in ckpt.files if f.host is None or f.host == ckpt.host]


def owner_elsewhere(session: Session, checkpoint_id: int | None, host: str) -> str | None:
    """The host holding checkpoint ``checkpoint_id``'s local files, if that is not ``host``: a
    step that touches them must not run here (a message from before hosts were routed)."""
    owner = session.scalar(select(Checkpoint.host).where(Checkpoint.id == checkpoint_id))
    return owner if owner is not None and owner != host else None


def _completed_at(session: Session, d: Detected, version: str) -> float:
    """When ``d``'s content was complete: its newest file's time, or, for a copy of content
    already recorded (``cp -r`` of an old checkpoint, a restore next to the run), when that
    content first was, so a copy never looks newer than a later save (pipeline.core.retention)."""
    first = session.scalar(select(func.min(Checkpoint.mtime)).where(Checkpoint.version == version))
    written = max(e.mtime_ns for e in d.entries) / 1e9
    return min(written, first) if first is not None else written


def _completed_again(ckpt: Checkpoint, d: Detected) -> None:
    """The same content found again at its path (touched, copied or restored back): its files'
    times are the ones on disk now (rotation compares them), but its completion time stays
    when that content first was complete: a copy or a restore is not a new save
    (pipeline.core.retention.recency)."""
    times = {e.relpath: e.mtime_ns for e in d.entries}
    for f in ckpt.files:
        if f.relpath in times and f.host is None:
            f.mtime_ns = times[f.relpath]


def record(session: Session, d: Detected, *, lease_seconds: float, detail: str,
           host: str | None = None, started_at: datetime | None = None) -> tuple[Checkpoint, Job, bool]:
    """Insert ``d`` as the current version at its path on ``host``, with a ``detected`` store
    job; ``(checkpoint, job, created)``.

    One path, many versions (docs/design.md, section 2): new content at a path makes every
    older version ``superseded`` (never counted, never latest, never what a restore by path
    means), whatever state it reached. The same content recorded again is returned as is
    (``created`` False); content that comes back after another version is current again
    and, if its store was superseded, stored again (unchanged shards are not re-sent).
    ``started_at``: when its hashing began (its uploads may have: pipeline.store.early).
    """
    version = d.version
    existing = session.scalar(select(Checkpoint).where(Checkpoint.path == str(d.path), Checkpoint.version == version,
                                                       Checkpoint.host.is_(None) if host is None
                                                       else Checkpoint.host == host))
    _supersede_others(session, str(d.path), host, keep=existing.id if existing is not None else None)
    ondisk.clear(session, str(d.path), host)  # what is on disk is this version now
    reference(session, {sha: p.size for shards in d.shards for p, sha in shards}
               | {r["sha256"]: r["size"] for f in d.remote for r in f.shards})
    if existing is not None:
        _claim(session, d.parts, existing.id)
        existing.current = True
        existing.local_present, existing.local_gone = True, None
        _completed_again(existing, d)
        job = latest_store_job(session, existing.id)
        # Saved again with the same bytes after it was superseded, vanished or forgotten: a new
        # save the user made (the newest of its run, by completion), protected again.
        if job is None or job.state in (S.SUPERSEDED, S.VANISHED, S.FORGOTTEN):
            existing.released_at = None
            existing.mtime = max(existing.mtime, max(e.mtime_ns for e in d.entries) / 1e9)  # completed now
            job = create_job(session, JobKind.STORE, checkpoint_id=existing.id, lease_seconds=lease_seconds,
                             bytes_total=existing.total_bytes, detail=f"{detail}: this content is back at its path",
                             started_at=started_at)
            return existing, job, True
        return existing, job, False

    ckpt = Checkpoint(
        path=str(d.path), run=str(d.run), name=d.path.name, is_dir=d.path.is_dir(), version=version,
        step=d.writer_step if d.writer_step is not None else roots.step_of(d.path.name),
        mtime=_completed_at(session, d, version),
        total_bytes=d.total_bytes, local_present=True, current=True, layout=d.layout or None,
        completed_by=d.completed_by, metrics=d.metrics, host=host,
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
    for r in d.remote:
        f = CheckpointFile(checkpoint_id=ckpt.id, relpath=r.relpath, size=r.size, sha256=r.sha256, format=r.format,
                           mtime_ns=r.mtime_ns, host=r.host)
        f.shards = [Shard(**row) for row in r.shards]
        session.add(f)
    _claim(session, d.parts, ckpt.id)
    job = create_job(session, JobKind.STORE, checkpoint_id=ckpt.id, lease_seconds=lease_seconds,
                     bytes_total=d.total_bytes, detail=detail, started_at=started_at)
    return ckpt, job, True


def _claim(session: Session, parts: tuple[int, ...], checkpoint_id: int) -> None:
    """The parts other hosts announced are now files of ``checkpoint_id``."""
    if not parts:  # most checkpoints: no query
        return
    for part in session.scalars(select(CheckpointPart).where(CheckpointPart.id.in_(parts))):
        part.checkpoint_id = checkpoint_id


def reference(session: Session, sizes: dict[str, int]) -> None:
    """The contents a checkpoint is about to reference: created live, or touched (locked, so a
    garbage collection deciding at the same moment either sees this reference or condemned
    the content first, and the shard step then revives it: docs/design.md, section 5)."""
    t = now()
    existing = {c.sha256: c for c in session.scalars(
        select(Content).where(Content.sha256.in_(sorted(sizes))).order_by(Content.sha256).with_for_update())}
    for sha, size in sizes.items():
        c = existing.get(sha)
        if c is None:
            session.add(Content(sha256=sha, size=size, state=ContentState.LIVE, created_at=t, last_referenced_at=t))
        else:
            c.last_referenced_at = t
    session.flush()


def _supersede_others(session: Session, path: str, host: str | None, keep: int | None) -> None:
    """Every other current version at ``path`` on ``host`` stops being current, and its store
    job ends ``superseded``: the path now holds other content there (another host's
    checkpoint at the same path is another checkpoint)."""
    for old in session.scalars(select(Checkpoint).where(Checkpoint.path == path, Checkpoint.current.is_(True),
                                                        on_host(host), Checkpoint.id != (keep or -1))):
        old.current = False
        if old.local_present:
            old.local_present, old.local_gone = False, "replaced"
        job = latest_store_job(session, old.id)
        if job is not None and states.allowed(JobKind.STORE, job.state, S.SUPERSEDED):
            transition(session, job.id, JobKind.STORE, job.state, S.SUPERSEDED, detail=f"new content at {path}")


def latest_store_job(session: Session, checkpoint_id: int) -> Job | None:
    return session.scalar(
        select(Job).where(Job.checkpoint_id == checkpoint_id, Job.kind == JobKind.STORE)
        .order_by(Job.id.desc()).limit(1)
    )


def resolve(session: Session, ref: str | int, host: str | None = None) -> Checkpoint:
    """A checkpoint by id, or the current version at a path (the newest recorded, if none is),
    this ``host``'s first when several hosts have one there."""
    text = str(ref)
    if text.isdigit():
        c = session.get(Checkpoint, int(text))
        if c is not None:
            return c
    c = session.scalar(
        select(Checkpoint).where(Checkpoint.path.in_(_as_recorded(text)))
        .order_by((Checkpoint.host == host).desc() if host is not None else Checkpoint.id.is_not(None),
                  Checkpoint.current.desc(), Checkpoint.id.desc()).limit(1)
    )
    if c is None:
        raise UnknownCheckpoint(text)
    return c


def resolve_run(session: Session, text: str) -> str:
    """The run directory ``text`` names (a path from the caller's directory: ``runs/llama`` in
    the project, ``../runs/llama`` below it) as the catalog records it; the absolute path when
    no checkpoint of it is recorded."""
    candidates = _as_recorded(text)
    found = session.scalar(select(Checkpoint.run).where(Checkpoint.run.in_(candidates)).limit(1))
    return found or candidates[0]


def _as_recorded(text: str) -> list[str]:
    """The absolute path ``text`` names (first), and the same with its parent's links resolved,
    as a path may be recorded."""
    path = os.path.abspath(os.path.expanduser(text))
    return [path, *sorted({str(Path(path).parent.resolve() / Path(path).name)} - {path})]


def file_path(ckpt: Checkpoint, f: CheckpointFile) -> str:
    return os.path.join(ckpt.path, f.relpath) if f.relpath else ckpt.path


def mark_vanished(session: Session, ckpt: Checkpoint) -> None:
    """The local copy is gone (deleted by hand, by the trainer's own rotation, or moved).

    A checkpoint that was not protected yet ends ``vanished``: nothing is left to protect,
    and status says so loudly; a protected one keeps its remote copies.
    """
    ckpt.local_present, ckpt.local_gone = False, "deleted"
    ckpt.disk_changed_at = ckpt.disk_changed = None
    job = latest_store_job(session, ckpt.id)
    if job is None:
        return
    if states.allowed(JobKind.STORE, job.state, S.VANISHED):
        transition(session, job.id, JobKind.STORE, job.state, S.VANISHED, last_error="vanished unprotected",
                   detail=f"the local copy vanished from {ckpt.path} before it was protected")
    else:
        note(session, job.id, f"local copy vanished from {ckpt.path}")
