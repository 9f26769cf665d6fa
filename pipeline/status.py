"""What ``ckpt status`` (and later the web UI) shows: plain dicts from the control plane."""
from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline.core.copies import Copy
from pipeline.core.health import replica_health, shard_health
from pipeline.db.engine import session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Job,
    Replica,
    Shard,
    StorageWorker,
)
from pipeline.db.replicas import fresh_after, good_copies_per_shard
from pipeline.settings import Settings
from pipeline.states import RETIRED, JobKind, WorkerState


def replica_counts(session: Session, checkpoint_ids: list[int]) -> dict[int, int]:
    """Per checkpoint: the fewest good copies (pipeline.core.copies) that any of its shards has."""
    if not checkpoint_ids:
        return {}
    per_shard = good_copies_per_shard(CheckpointFile.checkpoint_id.in_(checkpoint_ids))
    rows = session.execute(select(per_shard.c.cid, func.min(per_shard.c.n)).group_by(per_shard.c.cid))
    return {cid: n for cid, n in rows}


def checkpoint_health(session: Session, settings: Settings, ckpts: list[Checkpoint]) -> dict[int, dict[str, Any]]:
    """Per checkpoint: its worst shard health and the count of shards in each health."""
    out: dict[int, dict[str, Any]] = {}
    if not ckpts:
        return out
    since = fresh_after(settings.freshness_seconds)
    local = {c.id: c.local_present for c in ckpts}
    rows = session.execute(
        select(CheckpointFile.checkpoint_id, Shard.id, Replica.worker_id, Replica.state, StorageWorker.state,
               Replica.stored_at, Replica.verified_at)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .outerjoin(Replica, Replica.shard_id == Shard.id)
        .outerjoin(StorageWorker, StorageWorker.id == Replica.worker_id)
        .where(CheckpointFile.checkpoint_id.in_(list(local)))
    ).all()
    per_shard: dict[tuple[int, int], list[str]] = {}
    for cid, sid, worker_id, rstate, wstate, stored_at, verified_at in rows:
        reps = per_shard.setdefault((cid, sid), [])
        if rstate is not None and rstate not in RETIRED:
            copy = Copy(worker_id, rstate, wstate or WorkerState.DOWN, stored_at, verified_at)
            reps.append(replica_health(copy, since))
    for (cid, _sid), reps in per_shard.items():
        h = shard_health(reps, settings.rf, local[cid])
        entry = out.setdefault(cid, {"healthy": 0, "under-replicated": 0, "lost": 0})
        entry[h] += 1
    for entry in out.values():
        entry["health"] = "lost" if entry["lost"] else ("under-replicated" if entry["under-replicated"] else "healthy")
    return out


def job_dict(j: Job) -> dict[str, Any]:
    return {
        "id": j.id, "kind": j.kind, "checkpoint_id": j.checkpoint_id, "state": j.state, "attempts": j.attempts,
        "last_error": j.last_error, "blocked_reason": j.blocked_reason, "bytes_done": j.bytes_done,
        "bytes_total": j.bytes_total, "created_at": j.created_at, "updated_at": j.updated_at,
        "finished_at": j.finished_at, "params": j.params,
    }


def latest_store_jobs(session: Session) -> dict[int, Job]:
    """checkpoint id -> its newest store job (whose state is the checkpoint's state)."""
    latest = select(func.max(Job.id)).where(Job.kind == JobKind.STORE).group_by(Job.checkpoint_id)
    return {j.checkpoint_id: j for j in session.scalars(select(Job).where(Job.id.in_(latest)))
            if j.checkpoint_id is not None}


def checkpoint_rows(session: Session, settings: Settings, ckpts: list[Checkpoint],
                    jobs: dict[int, Job] | None = None) -> list[dict[str, Any]]:
    """What `ckpt status`, the web UI and the API show of each checkpoint."""
    jobs = latest_store_jobs(session) if jobs is None else jobs
    counts = replica_counts(session, [c.id for c in ckpts])
    health = checkpoint_health(session, settings, ckpts)
    out = []
    for c in ckpts:
        job, h = jobs.get(c.id), health.get(c.id, {})
        out.append({
            "id": c.id, "path": c.path, "run": c.run, "name": c.name, "version": c.version, "step": c.step,
            "total_bytes": c.total_bytes, "local_present": c.local_present, "detected_at": c.detected_at,
            "state": job.state if job else "unknown", "job_id": job.id if job else None,
            "blocked_reason": job.blocked_reason if job else None,
            "replicas_verified": counts.get(c.id, 0), "replicas_wanted": settings.rf,
            "health": h.get("health", "unprotected"),
            "shards": {k: v for k, v in h.items() if k != "health"},
        })
    return out


def worker_dict(w: StorageWorker) -> dict[str, Any]:
    return {"id": w.id, "url": w.url, "zone": w.zone, "source": w.source, "state": w.state,
            "free_bytes": w.free_bytes, "capacity_bytes": w.capacity_bytes, "last_seen": w.last_seen,
            "last_error": w.last_error}


def status(settings: Settings) -> dict[str, Any]:
    with session_scope(settings.db_url) as s:
        ckpts = list(s.scalars(select(Checkpoint).order_by(Checkpoint.id)))
        return {
            "checkpoints": checkpoint_rows(s, settings, ckpts),
            "jobs": [job_dict(j) for j in s.scalars(select(Job).order_by(Job.id))],
            "workers": [worker_dict(w) for w in s.scalars(select(StorageWorker).order_by(StorageWorker.id))],
        }
