"""Repair: bring every shard of a checkpoint back to RF copies that match the manifest.

A source is a replica whose fresh re-hash matches the manifest's SHA-256, or the local
copy if it still exists (the receiving worker checks its hash): never "primary wins". A
corrupt copy is quarantined on its worker (moved aside, not served, not counted) and
purged only after the new copy there re-hashed correctly. A shard with no good source is
``lost``: the job says so, and rotation stays blocked for its checkpoint.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.core.copies import good_workers
from pipeline.db.engine import one, session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Job,
    Replica,
    Shard,
    StorageWorker,
)
from pipeline.db.replicas import mark, place_replacement, shard_copies
from pipeline.db.transitions import create_job, note, now, renew_lease, transition
from pipeline.detection.catalog import file_path
from pipeline.errors import CkptError, WorkerError
from pipeline.settings import Settings
from pipeline.states import JobKind, ReplicaState
from pipeline.steps import Send, start_job
from pipeline.store.sharding import shard_prefix, source_matches

log = logging.getLogger("ckpt.repair")
P = states.RepairState


@dataclass
class ShardWork:
    shard_id: int
    label: str
    sha: str
    size: int
    kind: str
    src_path: str | None  # the local file, if the checkpoint still has it
    src_offset: int
    length: int
    tensors: tuple[str, ...]
    sources: list[tuple[str, str]] = field(default_factory=list)  # (worker id, url): readable copies
    fix_in_place: list[tuple[str, str, str]] = field(default_factory=list)  # (worker id, url, state)
    need: int = 0  # new replicas to place on other workers


def request_repair(session: Session, settings: Settings, checkpoint_id: int, reason: str) -> Job | None:
    """Create a repair job for the checkpoint unless one is already queued or running."""
    active = session.scalar(select(Job.id).where(Job.kind == JobKind.REPAIR, Job.checkpoint_id == checkpoint_id,
                                                 Job.state.in_(sorted(states.ACTIVE[JobKind.REPAIR]))).limit(1))
    if active is not None:
        return None
    return create_job(session, JobKind.REPAIR, checkpoint_id=checkpoint_id, params={"reason": reason},
                      lease_seconds=settings.lease_seconds, detail=reason)


def plan(s: Session, settings: Settings, checkpoint_id: int) -> list[ShardWork]:
    """The shards of a checkpoint that need work, as plain data."""
    ckpt = one(s, Checkpoint, checkpoint_id)
    good = {sc.sha256: len(good_workers(sc.copies)) for sc in shard_copies(s, checkpoint_id)}
    work = []
    for f in s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)):
        local = file_path(ckpt, f) if ckpt.local_present else None
        for sh in s.scalars(select(Shard).where(Shard.file_id == f.id).order_by(Shard.seq)):
            w = ShardWork(sh.id, f"shard {sh.seq} of {f.relpath or ckpt.name}", sh.sha256, sh.size, sh.kind, local,
                          sh.src_offset, sh.length, tuple(sh.tensors or ()))
            for r in s.scalars(select(Replica).where(Replica.shard_id == sh.id)):
                ws = r.worker.state
                if r.state in states.READABLE_COPIES and ws in states.READABLE_WORKERS:
                    w.sources.append((r.worker_id, r.worker.url))  # re-hashed before it is used
                elif r.state in states.DAMAGED and ws in states.COUNTING_WORKERS:
                    w.fix_in_place.append((r.worker_id, r.worker.url, r.state))
            w.need = max(0, settings.rf - good[sh.sha256] - len(w.fix_in_place))
            if w.fix_in_place or w.need:
                work.append(w)
    return work


def repair(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = start_job(s, settings, job_id, JobKind.REPAIR, P.QUEUED, P.REPAIRING)
        if job is None:
            return []
        checkpoint_id = one(s, Checkpoint, job.checkpoint_id).id

    key = settings.key()
    lost: list[str] = []
    fixed = 0
    for w in _passes(settings, checkpoint_id, lost):
        try:
            for worker_id, url, state in w.fix_in_place:
                _rebuild_on(settings, key, w, worker_id, url, quarantine_first=state == ReplicaState.CORRUPT)
                fixed += 1
            for _ in range(w.need):
                with session_scope(settings.db_url) as s:
                    target = place_replacement(s, one(s, Shard, w.shard_id)).worker_id
                    url = one(s, StorageWorker, target).url
                _rebuild_on(settings, key, w, target, url, quarantine_first=False)
                fixed += 1
        except _NoSource:
            lost.append(f"{w.label} ({w.sha[:12]})")
            for _worker_id, url, state in w.fix_in_place:  # every bad copy is set aside, none deleted
                if state == ReplicaState.CORRUPT:
                    _quarantine(key, url, w.sha)
        with session_scope(settings.db_url) as s:
            renew_lease(s, job_id, settings.lease_seconds)

    with session_scope(settings.db_url) as s:
        if lost:
            detail = "LOST: no copy matches the manifest for " + "; ".join(lost[:10])
            transition(s, job_id, JobKind.REPAIR, P.REPAIRING, P.LOST, detail=detail, last_error=detail)
            log.error("checkpoint %d: %s", checkpoint_id, detail)
            return []
        transition(s, job_id, JobKind.REPAIR, P.REPAIRING, P.DONE, detail=f"{fixed} replicas rebuilt and verified")
        run = one(s, Checkpoint, checkpoint_id).run
    log.info("checkpoint %d repaired: %d replicas rebuilt", checkpoint_id, fixed)
    return [Send("rotate_run", (run,))]


#: Re-plans after the first: replicas found bad while this repair ran (concurrent scrubs of
#: other workers) are fixed by it, not left for the next under-replication sweep.
MAX_PASSES = 4


def _passes(settings: Settings, checkpoint_id: int, lost: list[str]) -> Iterator[ShardWork]:
    """The shards to work on, planned again after each pass until nothing is left."""
    given_up: set[int] = set()
    for _ in range(MAX_PASSES):
        with session_scope(settings.db_url) as s:
            work = [w for w in plan(s, settings, checkpoint_id) if w.shard_id not in given_up]
        if not work:
            return
        for w in work:
            before = len(lost)
            yield w
            if len(lost) > before:
                given_up.add(w.shard_id)


class _NoSource(Exception):
    """Raised when every candidate source turned out bad while rebuilding."""


def _good_source(settings: Settings, key: bytes, w: ShardWork) -> WorkerClient | None:
    """The first readable replica whose re-hash, now, matches the manifest."""
    while w.sources:
        worker_id, url = w.sources[0]
        client = WorkerClient(url, key)
        try:
            (answer,) = client.verify([w.sha])
        except (WorkerError, ValueError):
            w.sources.pop(0)
            continue
        if answer["sha256"] == w.sha:
            return client
        w.sources.pop(0)
        with session_scope(settings.db_url) as s:  # it was counted as good: not any more
            t = now()
            state = ReplicaState.MISSING if answer["sha256"] is None else ReplicaState.CORRUPT
            mark(s, worker_id, w.sha, checked_at=t, state=state, last_error=f"re-hash at repair: {answer['sha256']}")
        if answer["sha256"] is not None:
            _quarantine(key, url, w.sha)
        w.fix_in_place.append((worker_id, url, ReplicaState.MISSING))  # set aside; rebuilt there like a missing copy
    return None


def _quarantine(key: bytes, url: str, sha: str) -> None:
    try:
        WorkerClient(url, key).quarantine([sha])
    except WorkerError as exc:  # it stays marked corrupt: never served by us, never counted
        log.warning("could not quarantine %s on %s: %s", sha[:12], url, exc)


def _rebuild_on(settings: Settings, key: bytes, w: ShardWork, worker_id: str, url: str, *,
                quarantine_first: bool) -> None:
    """Put a verified copy of the shard on ``worker_id``; raise :class:`_NoSource` if none exists."""
    target = WorkerClient(url, key)
    if quarantine_first:
        target.quarantine([w.sha])  # moved aside: not served, not counted, not yet deleted
    _transfer(settings, key, w, _good_source(settings, key, w), target)
    (answer,) = target.verify([w.sha])
    t = now()
    if answer["sha256"] != w.sha:
        with session_scope(settings.db_url) as s:
            mark(s, worker_id, w.sha, states=states.DAMAGED | {ReplicaState.PENDING}, state=ReplicaState.CORRUPT,
                 checked_at=t, last_error=f"re-hash after repair gave {answer['sha256']}")
        raise WorkerError(url, f"copy of {w.sha[:12]} did not verify after repair")
    with session_scope(settings.db_url) as s:
        mark(s, worker_id, w.sha, states=states.EXPECTED, state=ReplicaState.VERIFIED,
             stored_at=t, verified_at=t, checked_at=t, last_error=None)
        note_job_for(s, w, worker_id)
    target.purge_quarantined([w.sha])  # only now that the new copy verified


def _transfer(settings: Settings, key: bytes, w: ShardWork, source: WorkerClient | None,
              target: WorkerClient) -> None:
    """Copy the shard to ``target`` from a good replica, else from the local copy.

    The target hashes what it receives: a source that turns out bad is dropped for the next.
    Raises :class:`_NoSource` when nothing good is left; an unreachable target raises.
    """
    while source is not None:
        try:
            target.copy_from(source, w.sha, w.size)
            return
        except WorkerError as exc:
            if exc.worker == target.url and exc.status is None:
                raise  # the target is unreachable: retry the job later
            log.warning("repair of %s from %s failed (%s); trying the next copy", w.sha[:12], source.url, exc)
            w.sources.pop(0)
            source = _good_source(settings, key, w)
    if w.src_path is None:
        raise _NoSource()
    try:
        target.put_range(w.sha, shard_prefix(w.src_path, w.kind, w.tensors), w.src_path, w.src_offset, w.length)
    except WorkerError as exc:
        if exc.status != 422:
            raise
        if source_matches(w.src_path, w.kind, w.tensors, w.src_offset, w.length, w.sha):
            raise  # damaged on the way, the local copy is fine: the retry sends it again
        w.src_path = None  # the local copy no longer matches the manifest
        raise _NoSource() from None
    except (OSError, CkptError):
        w.src_path = None
        raise _NoSource() from None


def note_job_for(s: Session, w: ShardWork, worker_id: str) -> None:
    job = s.scalar(select(Job).join(Checkpoint, Job.checkpoint_id == Checkpoint.id)
                   .join(CheckpointFile, CheckpointFile.checkpoint_id == Checkpoint.id)
                   .join(Shard, Shard.file_id == CheckpointFile.id)
                   .where(Shard.id == w.shard_id, Job.kind == JobKind.REPAIR).order_by(Job.id.desc()).limit(1))
    if job is not None:
        note(s, job.id, f"{w.label} rebuilt on {worker_id} and verified")

