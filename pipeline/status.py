"""What ``ckpt status`` (and later the web UI) shows: plain dicts from the control plane."""
from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.core.health import shard_health, worker_healths
from pipeline.db.engine import session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Job,
    Shard,
    StorageWorker,
)
from pipeline.db.replicas import content_copies, fresh_after, good_copies_per_shard
from pipeline.db.transitions import now
from pipeline.detection import problems
from pipeline.settings import Settings
from pipeline.states import JobKind, StoreState


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
    shards = session.execute(
        select(CheckpointFile.checkpoint_id, Shard.id, Shard.sha256)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .where(CheckpointFile.checkpoint_id.in_(list(local)))
    ).all()
    copies = content_copies(session, {sha for _cid, _sid, sha in shards})
    cells = {sha: list(worker_healths(rows, since).values()) for sha, rows in copies.items()}
    for cid, _sid, sha in shards:
        h = shard_health(cells[sha], settings.rf, local[cid])
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
            "current": c.current, "layout": c.layout, "completed_by": c.completed_by,
            "written_at": datetime.fromtimestamp(c.mtime, tz=UTC),
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


def run_summaries(rows: list[dict[str, Any]], settings: Settings, at: datetime | None = None) -> list[dict[str, Any]]:
    """Per run, from the current versions' rows: the newest protected step and its age (the
    recovery point a node loss would give), and whether protection is falling behind the writer."""
    t = at or now()
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["current"]:
            by_run.setdefault(r["run"], []).append(r)

    def order(r: dict[str, Any]) -> tuple[bool, int, int]:
        return (r["step"] is not None, r["step"] or 0, r["id"])

    out = []
    for run, items in sorted(by_run.items()):
        newest = max(items, key=order)
        protected = [r for r in items if r["state"] in states.PROTECTED]
        best = max(protected, key=order) if protected else None
        waiting = (t - newest["detected_at"]).total_seconds()
        behind = None
        if newest["state"] not in states.PROTECTED and newest["state"] not in states.TERMINAL[JobKind.STORE] \
                and waiting >= settings.lag_warning_seconds:
            behind = (f"protection is behind: {newest['name']} was written {waiting / 60:.0f} min ago and is "
                      f"still {newest['state']}")
        out.append({
            "run": run, "checkpoints": len(items),
            "newest_step": newest["step"], "newest_name": newest["name"], "newest_state": newest["state"],
            "protected_step": best["step"] if best else None, "protected_name": best["name"] if best else None,
            "protected_id": best["id"] if best else None,
            "protected_age_s": (t - best["written_at"]).total_seconds() if best else None,
            "vanished_unprotected": sum(1 for r in items if r["state"] == StoreState.VANISHED),
            "behind": behind,
        })
    return out


def problem_dicts(session: Session) -> list[dict[str, Any]]:
    return [{"path": p.path, "run": p.run, "reason": p.reason, "first_seen": p.first_seen, "last_seen": p.last_seen}
            for p in problems.listed(session)]


def status(settings: Settings, *, all_versions: bool = False) -> dict[str, Any]:
    """Everything ``ckpt status`` shows: the current version of each checkpoint (every
    version with ``all_versions``), runs, jobs, storage workers and detection problems."""
    with session_scope(settings.db_url) as s:
        q = select(Checkpoint).order_by(Checkpoint.id)
        if not all_versions:
            q = q.where(Checkpoint.current.is_(True))
        rows = checkpoint_rows(s, settings, list(s.scalars(q)))
        return {
            "checkpoints": rows,
            "runs": run_summaries(rows if not all_versions else [r for r in rows if r["current"]], settings),
            "jobs": [job_dict(j) for j in s.scalars(select(Job).order_by(Job.id))],
            "workers": [worker_dict(w) for w in s.scalars(select(StorageWorker).order_by(StorageWorker.id))],
            "problems": problem_dicts(s),
        }
