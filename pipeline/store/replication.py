"""The replicate step: one replica of one shard onto one storage worker, then fan-in.

Once stored, the worker re-hashes the replica from its disk (page cache dropped) and the
answer is compared to the manifest: a match makes the replica ``verified`` here, so the
verify step only has to re-hash what was not verified yet.

Fan-in is decided in the database: the replica that completes the set moves the job
``sharded -> replicated`` with a compare-and-set, so exactly one delivery enqueues verify.
A worker that cannot be reached, or whose disk is full, is marked down and the replica
moves to another live worker (a down worker never blocks a store while RF distinct live
workers remain).
"""
from __future__ import annotations

import logging

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.engine import one, session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Job,
    Replica,
    Shard,
    StorageWorker,
)
from pipeline.db.replicas import place_replacement
from pipeline.db.transitions import note, now, renew_lease, transition
from pipeline.detection.catalog import file_path
from pipeline.errors import AttemptsExhausted, PlacementError, WorkerError
from pipeline.settings import Settings
from pipeline.states import JobKind, ReplicaState, WorkerState
from pipeline.steps import Send
from pipeline.store.sharding import shard_prefix, source_matches

log = logging.getLogger("ckpt.replicate")
S = states.StoreState


def job_of_replica(session: Session, replica_id: int) -> Job | None:
    return session.scalar(
        select(Job).join(Checkpoint, Job.checkpoint_id == Checkpoint.id)
        .join(CheckpointFile, CheckpointFile.checkpoint_id == Checkpoint.id)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .join(Replica, Replica.shard_id == Shard.id)
        .where(Replica.id == replica_id, Job.kind == JobKind.STORE)
        .order_by(Job.id.desc()).limit(1)
    )


def replicate(settings: Settings, replica_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        rep = s.get(Replica, replica_id)
        if rep is None:
            return []
        job = job_of_replica(s, replica_id)
        if job is None or job.state != S.SHARDED:
            return []  # finished, superseded or failed meanwhile
        if rep.state in states.SENT:
            return _fan_in(s, settings, job.id)
        if rep.state != ReplicaState.PENDING:
            return []
        rep.attempts += 1
        if rep.attempts > settings.max_attempts:
            raise AttemptsExhausted(f"replica {replica_id}", rep.attempts - 1, rep.last_error)
        renew_lease(s, job.id, settings.lease_seconds)
        shard, worker = rep.shard, rep.worker
        f = shard.file
        src = file_path(f.checkpoint, f)
        kind, tensors = shard.kind, tuple(shard.tensors or ())
        job_id, url, sha, size = job.id, worker.url, shard.sha256, shard.size
        src_offset, length, worker_id = shard.src_offset, shard.length, worker.id

    client = WorkerClient(url, settings.key())
    try:
        held = client.head(sha)
        if held != size:
            client.put_range(sha, shard_prefix(src, kind, tensors), src, src_offset, length)
        # Re-hashed from the worker's disk now, while other replicas are still uploading,
        # rather than all together in the verify step once the last upload is done.
        rehashed = client.verify([sha])[0]["sha256"]
    except WorkerError as exc:
        if exc.status == 422:
            # What the worker received does not hash to the manifest. Either the source
            # changed under us, or the bytes were damaged on the way: read it again here.
            if source_matches(src, kind, tensors, src_offset, length, sha):
                raise WorkerError(url, f"shard {sha[:12]} arrived damaged (the source is intact); "
                                       "sending it again") from exc
            with session_scope(settings.db_url) as s:
                transition(s, job_id, JobKind.STORE, S.SHARDED, S.SUPERSEDED, detail=str(exc), last_error=str(exc))
            return []
        if exc.status is None or exc.status == 507:  # unreachable or full: place this replica elsewhere
            return _move_off(settings, replica_id, worker_id, str(exc))
        raise
    except OSError as exc:
        # The source is gone (vanished, before it was protected) or unreadable (superseded).
        end = S.VANISHED if isinstance(exc, FileNotFoundError) else S.SUPERSEDED
        with session_scope(settings.db_url) as s:
            transition(s, job_id, JobKind.STORE, S.SHARDED, end, detail=f"{src}: {exc}", last_error=str(exc))
        return []

    with session_scope(settings.db_url) as s:
        t = now()
        # A copy that does not re-hash to its name stays "stored": the verify step finds it
        # corrupt and replaces it.
        done = ({"state": ReplicaState.VERIFIED, "verified_at": t} if rehashed == sha
                else {"state": ReplicaState.STORED})
        s.execute(update(Replica).where(Replica.id == replica_id, Replica.state == ReplicaState.PENDING)
                  .values(stored_at=t, checked_at=t, last_error=None, **done))
        s.execute(update(Job).where(Job.id == job_id).values(bytes_done=Job.bytes_done + size))
        return _fan_in(s, settings, job_id)


def _fan_in(s: Session, settings: Settings, job_id: int) -> list[Send]:
    job = one(s, Job, job_id)
    pending = s.scalar(
        select(func.count(Replica.id)).join(Shard).join(CheckpointFile)
        .where(CheckpointFile.checkpoint_id == job.checkpoint_id, Replica.state == ReplicaState.PENDING)
    )
    if pending:
        return []
    if transition(s, job_id, JobKind.STORE, S.SHARDED, S.REPLICATED, lease_seconds=settings.lease_seconds,
                  detail="every shard has RF stored replicas", bytes_done=job.bytes_total):
        return [Send("verify", (job_id,))]
    return []


def _move_off(settings: Settings, replica_id: int, worker_id: str, error: str) -> list[Send]:
    with session_scope(settings.db_url) as s:
        worker = one(s, StorageWorker, worker_id)
        worker.state, worker.last_error = WorkerState.DOWN, error
        rep = one(s, Replica, replica_id)
        if rep.state != ReplicaState.PENDING:
            return []
        rep.state, rep.last_error = ReplicaState.ABANDONED, error
        try:
            moved = place_replacement(s, rep.shard)
        except PlacementError:  # nowhere else to go: roll back, and let the retry wait for a worker
            raise WorkerError(worker.url, f"{error}; no other live worker to take the replica") from None
        target = moved.worker_id
        job = job_of_replica(s, replica_id)
        if job is not None:
            note(s, job.id, f"worker {worker_id} unreachable ({error}); shard {rep.shard.sha256[:12]} "
                            f"moves to {target}")
        log.warning("replica %d: %s unreachable, moved to %s", replica_id, worker_id, target)
        return [Send("replicate", (moved.id,))]
