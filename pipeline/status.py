"""What ``ckpt status`` (and later the web UI) shows: plain dicts from the control plane."""
from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from pipeline import degraded, states
from pipeline.core import health as health_of
from pipeline.core.health import shard_health, worker_healths
from pipeline.db import hosts
from pipeline.db import jobs as job_lookup
from pipeline.db.copies import content_copies, fresh_after, good_copies_per_shard, good_copy
from pipeline.db.engine import session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    Content,
    ContentCopy,
    Job,
    RunStateCount,
    Shard,
    StorageWorker,
    TrainingHost,
)
from pipeline.db.newest import newest, newest_protected
from pipeline.db.transitions import latest_store_ids, now
from pipeline.detection import problems, waits
from pipeline.objectstore import report as objectstore_report
from pipeline.settings import Settings
from pipeline.states import ContentState, JobKind, StoreState


def replica_counts(session: Session, checkpoint_ids: list[int]) -> dict[int, int]:
    """Per checkpoint: the fewest good copies (pipeline.core.copies) that any of its shards has."""
    if not checkpoint_ids:
        return {}
    per_shard = good_copies_per_shard(CheckpointFile.checkpoint_id.in_(checkpoint_ids))
    rows = session.execute(select(per_shard.c.cid, func.min(per_shard.c.n)).group_by(per_shard.c.cid))
    return {cid: n for cid, n in rows}


def shard_counts(session: Session, settings: Settings, ckpts: list[Checkpoint]) -> dict[int, dict[str, int]]:
    """Per checkpoint: the count of its shards in each shard health (the checkpoint's own
    health is pipeline.core.health.checkpoint_health of these and its state)."""
    out: dict[int, dict[str, int]] = {}
    if not ckpts:
        return out
    since = fresh_after(settings.freshness_seconds)
    local = {c.id: c.local_present for c in ckpts}
    rf = {c.id: settings.rf_for(c.run) for c in ckpts}  # a checkpoint's shards are owed its run's RF
    shards = session.execute(
        select(CheckpointFile.checkpoint_id, Shard.id, Shard.sha256)
        .join(Shard, Shard.file_id == CheckpointFile.id)
        .where(CheckpointFile.checkpoint_id.in_(list(local)))
    ).all()
    copies = content_copies(session, {sha for _cid, _sid, sha in shards})
    cells = {sha: list(worker_healths(rows, since).values()) for sha, rows in copies.items()}
    for cid, _sid, sha in shards:
        h = shard_health(cells[sha], rf[cid], local[cid])
        entry = out.setdefault(cid, {"healthy": 0, "under-replicated": 0, "lost": 0})
        entry[h] += 1
    return out


def iso(t: datetime) -> str:
    """A time as ISO 8601 in UTC, to the millisecond: ``2026-11-22T10:30:33.599Z``."""
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def jsonable(o: Any) -> Any:
    """``json.dumps(default=...)`` for what status holds: times as ISO 8601, the rest as text."""
    return iso(o) if isinstance(o, datetime) else str(o)


def job_dict(j: Job) -> dict[str, Any]:
    return {
        "id": j.id, "kind": j.kind, "checkpoint_id": j.checkpoint_id, "state": j.state, "attempts": j.attempts,
        "last_error": j.last_error, "blocked_reason": j.blocked_reason, "bytes_done": j.bytes_done,
        "bytes_total": j.bytes_total, "created_at": j.created_at, "updated_at": j.updated_at,
        "finished_at": j.finished_at, "params": j.params,
    }


def checkpoint_rows(session: Session, settings: Settings, ckpts: list[Checkpoint],
                    jobs: dict[int, Job] | None = None) -> list[dict[str, Any]]:
    """What `ckpt status`, the web UI and the API show of each checkpoint."""
    jobs = store_jobs_of(session, [c.id for c in ckpts]) if jobs is None else jobs
    counts = replica_counts(session, [c.id for c in ckpts])
    health = shard_counts(session, settings, ckpts)
    silent = silent_hosts(session, {c.host for c in ckpts if c.host})
    on_stores = objectstore_report.confirmed(session, settings, ckpts)
    out = []
    for c in ckpts:
        job, h = jobs.get(c.id), health.get(c.id, {})
        state = job.state if job else "unknown"
        blocked = job.blocked_reason if job else None
        if job is not None and c.host in silent and job.state in states.ACTIVE[JobKind.STORE]:
            blocked = f"waiting for host {c.host}: {silent[c.host]} (its files are there)"
        out.append({
            "id": c.id, "path": c.path, "run": c.run, "name": c.name, "version": c.version, "step": c.step,
            "total_bytes": c.total_bytes, "local_present": c.local_present, "detected_at": c.detected_at,
            "local_gone": c.local_gone, "local_copy": health_of.local_copy(c.local_present, c.local_gone),
            "current": c.current, "layout": c.layout, "completed_by": c.completed_by,
            "pinned": c.pinned, "pin_note": c.pin_note, "metrics": c.metrics or {},
            "written_at": datetime.fromtimestamp(c.mtime, tz=UTC),
            "state": state, "job_id": job.id if job else None,
            "blocked_reason": blocked, "host": c.host,
            "disk_changed": c.disk_changed, "disk_changed_at": c.disk_changed_at,
            "replicas_verified": counts.get(c.id, 0), "replicas_wanted": settings.rf_for(c.run),
            "health": health_of.checkpoint_health(state, h), "shards": h,
            "objectstore": on_stores.get(c.id),
        })
    return out


#: A training host whose watcher has not reported in for this long is called silent.
HOST_SILENT_SECONDS = 60.0


def silent_hosts(session: Session, names: set[str]) -> dict[str, str]:
    """Of ``names``, the hosts that have not reported in lately: name -> since when, in words."""
    if not names:
        return {}
    seen = dict(session.execute(select(TrainingHost.name, TrainingHost.last_seen)
                                .where(TrainingHost.name.in_(sorted(names)))).all())
    t = now()
    out = {}
    for name in names:
        last = seen.get(name)
        if last is None:
            out[name] = "it never reported in"
        elif (t - last).total_seconds() > HOST_SILENT_SECONDS:
            out[name] = f"not seen for {(t - last).total_seconds() / 60:.0f} min"
    return out


def worker_dict(w: StorageWorker) -> dict[str, Any]:
    return {"id": w.id, "url": w.url, "zone": w.zone, "source": w.source, "state": w.state, "tier": w.tier,
            "free_bytes": w.free_bytes, "capacity_bytes": w.capacity_bytes, "used_bytes": w.used_bytes,
            "last_seen": w.last_seen,
            "last_error": w.last_error}


def run_facts(session: Session, runs: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per run (current versions only): how many checkpoints by state, the newest, the newest
    protected: the counts kept as data (``run_state_counts``) and two lookups per run,
    whatever the runs' length."""
    scope = [RunStateCount.checkpoints > 0]
    scope += [RunStateCount.run.in_(runs)] if runs is not None else []
    q = select(RunStateCount.run, RunStateCount.store_state, RunStateCount.local_present,
               RunStateCount.checkpoints, RunStateCount.bytes).where(*scope)
    out: dict[str, dict[str, Any]] = {}
    for run, state, local, n, size in session.execute(q):
        entry = out.setdefault(run, {"count": 0, "by_state": {}, "newest": None, "protected": None,
                                     "protected_bytes": 0, "unprotected_bytes": 0})
        entry["count"] += n
        entry["by_state"][state] = entry["by_state"].get(state, 0) + n
        if state in states.PROTECTED:
            entry["protected_bytes"] += int(size)
        elif local:
            entry["unprotected_bytes"] += int(size)
    changed = changed_on_disk(session, list(out))
    for run, entry in out.items():
        entry["newest"] = newest(session, run)
        found = newest_protected(session, run)
        entry["protected"] = found[0] if found else None
        #: every checkpoint of that save (its shards too, for a save written side by side)
        entry["protected_save"] = {c.id for c in (found[0], *found[1])} if found else set()
        entry["changed_on_disk"] = changed.get(run, 0)
    return out


def changed_on_disk(session: Session, runs: list[str]) -> dict[str, int]:
    """Per run: current checkpoints whose files on disk are not their recorded version
    (pipeline.detection.ondisk): "changed on disk, not protected"."""
    if not runs:
        return {}
    # Read from the partial index that holds only the flagged checkpoints (migration 0019), and
    # counted here: grouped in SQL, SQLite walks every checkpoint along the run index instead.
    q = select(Checkpoint.run).where(Checkpoint.disk_changed_at.is_not(None), Checkpoint.current.is_(True))
    wanted = set(runs)
    return dict(Counter(run for run in session.scalars(q) if run in wanted))


def run_summaries(session: Session, settings: Settings, at: datetime | None = None, runs: list[str] | None = None,
                  facts: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per run: the newest protected step and its age (the recovery point a node loss would
    give), whether protection is falling behind the writer, and the remote retention policy."""
    t = at or now()
    facts = run_facts(session, runs) if facts is None else facts
    shown = [c for f in facts.values() for c in (f["newest"], f["protected"]) if c is not None]
    rows = {r["id"]: r for r in checkpoint_rows(session, settings, list({c.id: c for c in shown}.values()))}
    out = []
    for run, f in sorted(facts.items()):
        newest = rows[f["newest"].id]
        best = rows[f["protected"].id] if f["protected"] is not None else None
        items = {"count": f["count"]}
        waiting = (t - newest["detected_at"]).total_seconds()
        behind = None
        if newest["state"] not in states.PROTECTED and newest["state"] not in states.TERMINAL[JobKind.STORE] \
                and waiting >= settings.lag_warning_seconds:
            behind = (f"protection is behind: {newest['name']} was written {waiting / 60:.0f} min ago and is "
                      f"still {newest['state']}")
        elif newest["state"] in states.PROTECTED and newest["id"] not in f.get("protected_save", {newest["id"]}) \
                and waiting >= settings.lag_warning_seconds:
            behind = (f"protection is behind: {newest['name']} was written {waiting / 60:.0f} min ago, and the save "
                      "it is a file of is not protected whole")
        policy = settings.policy_for(run)
        out.append({
            "run": run, "checkpoints": items["count"], "by_state": f["by_state"],
            "policy": policy.describe(), "policy_set": policy.is_set,
            "newest_step": newest["step"], "newest_name": newest["name"], "newest_state": newest["state"],
            "protected_step": best["step"] if best else None, "protected_name": best["name"] if best else None,
            "protected_id": best["id"] if best else None,
            "protected_age_s": (t - best["written_at"]).total_seconds() if best else None,
            "vanished_unprotected": f["by_state"].get(StoreState.VANISHED.value, 0),
            "changed_on_disk": f.get("changed_on_disk", 0),
            "behind": behind,
        })
    return out


def lost_contents() -> Select[Any]:
    """Live contents of which no worker holds a good copy (pipeline.core.copies)."""
    # Each live content looks up its own copies (the (worker, content) index): the set of every
    # good copy, built first and then compared, read every copy row (~70 ms at 100k checkpoints).
    good = (select(ContentCopy.id).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .where(ContentCopy.sha256 == Content.sha256, good_copy()))
    return select(Content.sha256).where(Content.state == ContentState.LIVE, ~good.exists())


def lost_checkpoints(s: Session) -> int:
    """Current protected checkpoints without a local copy that reference a content no worker
    holds a good copy of."""
    lost = lost_contents()
    if s.scalar(lost.limit(1)) is None:  # the usual answer, without joining every checkpoint
        return 0
    return s.scalar(
        select(func.count(func.distinct(Checkpoint.id))).join(CheckpointFile).join(Shard)
        .where(Checkpoint.current.is_(True), Checkpoint.local_present.is_(False),
               Checkpoint.store_state.in_(sorted(states.PROTECTED)), Shard.sha256.in_(lost))) or 0


def degraded_runs(settings: Settings) -> list[dict[str, Any]]:
    """The runs whose protection through their trainer is failing (pipeline.degraded)."""
    return [d.as_dict() for d in degraded.listed(settings.home)]


def problem_dicts(session: Session) -> list[dict[str, Any]]:
    return [{"path": p.path, "host": p.host or None, "run": p.run, "reason": p.reason,
             "first_seen": p.first_seen, "last_seen": p.last_seen}
            for p in problems.listed(session)]


def checkpoint_page(session: Session, *, all_versions: bool = False, run: str | None = None,
                    state: str | None = None, before: int | None = None, limit: int = 50,
                    search: str | None = None, order: tuple[Any, ...] = (), offset: int = 0) -> list[Checkpoint]:
    """Checkpoints newest first (by id), filtered, one page: ids below ``before``. ``search``:
    only those whose path holds this text (any case). ``order`` (the web UI's sortable
    columns): sorted by it first, then newest first, pages by ``offset``."""
    q = select(Checkpoint).order_by(*order, Checkpoint.id.desc()).offset(offset).limit(limit)
    if search:
        q = q.where(func.lower(Checkpoint.path).contains(search.lower(), autoescape=True))
    if not all_versions:
        q = q.where(Checkpoint.current.is_(True))
    if run:
        q = q.where(Checkpoint.run == run)
    if before:
        q = q.where(Checkpoint.id < before)
    if state:
        q = q.where(Checkpoint.store_state == state)
    return list(session.scalars(q))


def status(settings: Settings, *, all_versions: bool = False, run: str | None = None, state: str | None = None,
           before: int | None = None, limit: int = 50, search: str | None = None,
           run_usage: bool = True) -> dict[str, Any]:
    """Everything ``ckpt status`` shows: runs, one page of checkpoints (the current versions,
    every version with ``all_versions``; newest first; ``search``: whose path holds that text),
    unfinished jobs, storage workers, capacity, detection problems, the entries waiting to be
    recorded (pipeline.detection.waits) and the runs whose
    protection through their trainer is degraded. ``run_usage=False``: without each run's
    stored bytes (``run_usage`` is then empty), which the one-line-per-run view does not show
    and which reads every kept checkpoint's contents."""
    from pipeline import capacity

    with session_scope(settings.db_url, readonly=True) as s:
        page = checkpoint_page(s, all_versions=all_versions, run=run, state=state, before=before, limit=limit,
                               search=search)
        rows = checkpoint_rows(s, settings, page, jobs=store_jobs_of(s, [c.id for c in page]))
        jobs = job_lookup.newest(s, job_lookup.active_pairs() + job_lookup.failed_pairs(), limit=200)
        usage = capacity.usage(s, settings)
        return {
            "checkpoints": rows,
            "next_before": rows[-1]["id"] if len(rows) == limit else None,
            "runs": run_summaries(s, settings, runs=[run] if run else None),
            "jobs": [job_dict(j) for j in jobs],
            "workers": [worker_dict(w) for w in s.scalars(select(StorageWorker).order_by(StorageWorker.id))],
            "objectstores": objectstore_report.targets(s, settings),
            "capacity": usage.as_dict(),
            "run_usage": capacity.per_run(s, [run] if run else None) if run_usage else {},
            "problems": problem_dicts(s),
            "waiting": waits.listed(s, now(), [run] if run else None),
            "degraded": degraded_runs(settings),
            "this_host": {"id": settings.host_id, "label": settings.host_label},
            "hosts": [dataclasses.asdict(h) for h in hosts.listed(s, settings)],
        }


def store_jobs_of(session: Session, checkpoint_ids: list[int]) -> dict[int, Job]:
    """checkpoint id -> its newest store job, for the given checkpoints only."""
    if not checkpoint_ids:
        return {}
    latest = latest_store_ids(Job.checkpoint_id.in_(checkpoint_ids))
    return {j.checkpoint_id: j for j in session.scalars(select(Job).where(Job.id.in_(latest)))
            if j.checkpoint_id is not None}
