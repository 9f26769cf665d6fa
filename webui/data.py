"""What the pages and the JSON API show, as plain dicts, from the control plane.

Pages and API read the same functions, so the browser and scripts see the same data.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Text, and_, cast, func, or_, select
from sqlalchemy.orm import Session, selectinload

from pipeline import capacity, states
from pipeline.core.health import COUNTS, checkpoint_health, shard_health, worker_healths
from pipeline.db import hosts as db_hosts
from pipeline.db import jobs as job_lookup
from pipeline.db.copies import content_copies, fresh_after, held_per_worker
from pipeline.db.engine import session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    ContentCopy,
    Job,
    JobEvent,
    Shard,
    StorageWorker,
)
from pipeline.db.newest import newest_first
from pipeline.db.transitions import now
from pipeline.detection import waits
from pipeline.errors import UnknownCheckpoint, UnknownJob, UnknownRun
from pipeline.objectstore import report as objectstore_report
from pipeline.settings import Settings
from pipeline.states import RETIRED, JobKind, StoreState, Tier, WorkerState
from pipeline.status import (
    checkpoint_page,
    checkpoint_rows,
    degraded_runs,
    job_dict,
    lost_checkpoints,
    problem_dicts,
    run_facts,
    run_summaries,
    worker_dict,
)

#: Rows per page of the checkpoint and job lists.
PAGE = 100


def checkpoints(settings: Settings, *, state: str | None = None, run: str | None = None,
                all_versions: bool = False, before: int | None = None, limit: int = PAGE,
                search: str | None = None, order: tuple[Any, ...] = (), offset: int = 0) -> list[dict[str, Any]]:
    """One page of the current version of each checkpoint (every version with
    ``all_versions``), newest first: ids below ``before``; ``search`` in their paths;
    ``order``/``offset``: a sorted list's page (webui.sorting)."""
    with session_scope(settings.db_url, readonly=True) as s:
        page = checkpoint_page(s, all_versions=all_versions, run=run, state=state, before=before, limit=limit,
                               search=search, order=order, offset=offset)
        return checkpoint_rows(s, settings, page)


def run(settings: Settings, name: str, *, state: str | None = None, search: str | None = None,
        page: int = 0, limit: int = PAGE, order: tuple[Any, ...] = ()) -> dict[str, Any]:
    """One run: its summary (newest protected step, policy, usage) and one page of its current
    checkpoints by step, newest first, each marked protected or not."""
    with session_scope(settings.db_url, readonly=True) as s:
        summary = next(iter(run_summaries(s, settings, runs=[name])), None)
        if summary is None:
            raise UnknownRun(name)
        q = (select(Checkpoint).where(Checkpoint.run == name, Checkpoint.current.is_(True))
             .order_by(*order, *newest_first()).offset(page * limit).limit(limit + 1))
        if state:
            q = q.where(Checkpoint.store_state == state)
        if search:
            q = q.where(contains(Checkpoint.path, search))
        found = list(s.scalars(q))
        rows = checkpoint_rows(s, settings, found[:limit])
        for r in rows:
            r["protected"] = r["state"] in states.PROTECTED
        return {"summary": summary, "usage": capacity.per_run(s, [name]).get(name, {"unique": 0, "shared": 0}),
                "checkpoints": rows, "more": len(found) > limit, "waiting": waits.listed(s, now(), [name])}


def paged(rows: list[dict[str, Any]], page: int, limit: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Page ``page`` (from 0) of a short list read whole (workers, dead letters), and whether
    there is another."""
    limit = limit or PAGE
    start = max(0, page) * limit
    return rows[start:start + limit], len(rows) > start + limit


def contains(column: Any, text: str) -> ColumnElement[bool]:
    """``column`` holds ``text``, in any case (the lists' search)."""
    return func.lower(column).contains(text.lower(), autoescape=True)


def runs(settings: Settings) -> list[str]:
    with session_scope(settings.db_url, readonly=True) as s:
        return list(s.scalars(select(Checkpoint.run).distinct().order_by(Checkpoint.run)))


def checkpoint(settings: Settings, checkpoint_id: int) -> dict[str, Any]:
    """One checkpoint with its files, shard manifest and every replica's health."""
    since = fresh_after(settings.freshness_seconds)
    with session_scope(settings.db_url, readonly=True) as s:
        c = s.get(Checkpoint, checkpoint_id)
        if c is None:
            raise UnknownCheckpoint(str(checkpoint_id))
        (out,) = checkpoint_rows(s, settings, [c])
        shas = s.scalars(select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == c.id))
        copies = content_copies(s, set(shas))
        per_worker = {sha: worker_healths(rows, since) for sha, rows in copies.items()}
        stores = {w.id: {"last_error": w.last_error}  # the object stores, for why their copies wait
                  for w in s.scalars(select(StorageWorker).where(StorageWorker.tier == Tier.OBJECT_STORE))}
        wanted = out["objectstore"]["wanted"] if out["objectstore"] else 0
        on_stores = {sha: objectstore_report.shard(rows, since, wanted) for sha, rows in copies.items()}
        shown = bool(out["objectstore"]) or any(o["cells"] for o in on_stores.values())
        rows_of: dict[str, list[ContentCopy]] = {}
        for r in s.scalars(select(ContentCopy).where(ContentCopy.sha256.in_(list(per_worker)),
                                                     ContentCopy.state.not_in(sorted(RETIRED)))
                           .order_by(ContentCopy.worker_id)):
            rows_of.setdefault(r.sha256, []).append(r)
        files = []
        for f in s.scalars(select(CheckpointFile).where(CheckpointFile.checkpoint_id == c.id)
                           .order_by(CheckpointFile.relpath)):
            shards = []
            for sh in s.scalars(select(Shard).where(Shard.file_id == f.id).order_by(Shard.seq)):
                reps = [{
                    "worker_id": r.worker_id, "state": r.state, "stored_at": r.stored_at,
                    "verified_at": r.verified_at, "checked_at": r.checked_at, "last_error": r.last_error,
                    "health": per_worker[sh.sha256].get(r.worker_id, "missing"),
                } for r in rows_of.get(sh.sha256, []) if r.worker_id not in stores]
                shards.append({
                    "seq": sh.seq, "kind": sh.kind, "sha256": sh.sha256, "size": sh.size,
                    "src_offset": sh.src_offset, "length": sh.length, "tensors": len(sh.tensors or []),
                    "first_tensor": sh.tensors[0] if sh.tensors else None, "replicas": reps,
                    "health": checkpoint_health(out["state"], {shard_health(list(per_worker[sh.sha256].values()),
                                                                           settings.rf_for(c.run),
                                                                           c.local_present): 1}),
                    "objectstore": _on_stores(on_stores[sh.sha256], rows_of.get(sh.sha256, []), stores)
                    if shown else None,
                })
            files.append({"relpath": f.relpath or c.name, "size": f.size, "sha256": f.sha256, "format": f.format,
                          "shards": shards})
        out["objectstore_line"] = objectstore_report.words(out["objectstore"]) if out["objectstore"] else None
        out["files"] = files
        out["versions"] = [{"id": v.id, "version": v.version, "detected_at": v.detected_at, "current": v.current,
                            "state": v.store_state or "-"}
                           for v in s.scalars(select(Checkpoint).where(
                               Checkpoint.path == c.path,
                               Checkpoint.host.is_(None) if c.host is None else Checkpoint.host == c.host)
                               .order_by(Checkpoint.id.desc()).limit(20))]
        out["jobs"] = [job_dict(j) for j in s.scalars(select(Job).where(Job.checkpoint_id == c.id)
                                                       .order_by(Job.id.desc()))]
        return out


def _on_stores(state: dict[str, Any], rows: list[ContentCopy], stores: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One shard's copy state on the object stores (pipeline.objectstore.report.shard) with each
    copy and why it waits: the copy's own error, else its store's (refused credentials,
    throttling); ``error``: the first such reason of a shard not confirmed (with no copy placed,
    a store's: why none could be)."""
    copies = [{"target": r.worker_id, "state": r.state, "health": state["cells"].get(r.worker_id, "missing"),
               "last_error": r.last_error or stores[r.worker_id]["last_error"], "verified_at": r.verified_at}
              for r in rows if r.worker_id in stores]
    reasons = [o["last_error"] for o in copies if o["health"] not in COUNTS] if copies else \
        [o["last_error"] for o in stores.values()]
    error = next((e for e in reasons if e), None) if state["state"] != "confirmed" else None
    return {"state": state["state"], "confirmed": state["confirmed"], "wanted": state["wanted"], "copies": copies,
            "error": error}


def health(settings: Settings, *, problems_only: bool = False, before: int | None = None,
           limit: int = 20) -> dict[str, Any]:
    """The shard health matrix: one column per storage worker, one row per shard, grouped by
    checkpoint (newest first, ``limit`` checkpoints a page, ids below ``before``), with the
    counts of the page. ``problems_only``: only shards that are not healthy, and the
    checkpoints holding them. A released checkpoint (forgotten, vanished) is owed no copy: not
    shown, not counted (pipeline.core.health.checkpoint_health)."""
    since = fresh_after(settings.freshness_seconds)
    with session_scope(settings.db_url, readonly=True) as s:
        q = select(Checkpoint).where(Checkpoint.current.is_(True), Checkpoint.released_at.is_(None)
                                     ).order_by(Checkpoint.id.desc())
        if before:
            q = q.where(Checkpoint.id < before)
        if problems_only:  # the checkpoints whose health is not plain: read by pages, not all at once
            q = q.where(Checkpoint.store_state.in_(sorted(states.RESTORABLE)))
        workers = [w.id for w in s.scalars(select(StorageWorker).where(
            StorageWorker.state.not_in([WorkerState.REJECTED, WorkerState.CANDIDATE]),
            StorageWorker.tier == Tier.WORKERS).order_by(StorageWorker.id))]
        matrices: list[dict[str, Any]] = []
        replica_totals: dict[str, int] = {}
        shard_totals: dict[str, int] = {}
        last_id = None
        for page in _pages(s, q.options(selectinload(Checkpoint.files).selectinload(CheckpointFile.shards)), limit):
            shas = {sh.sha256 for c in page for f in c.files for sh in f.shards}
            per_worker = {sha: worker_healths(rows, since) for sha, rows in content_copies(s, shas).items()}
            for c in page:
                last_id = c.id
                m = _matrix(c, per_worker, workers, settings.rf_for(c.run), problems_only, replica_totals, shard_totals)
                if m is not None:
                    matrices.append(m)
                if len(matrices) == limit:
                    break
            if len(matrices) == limit or not problems_only:
                break
        return {"checkpoints": matrices, "replicas": replica_totals, "shards": shard_totals, "workers": workers,
                "older": last_id if len(matrices) == limit else None}


def _pages(s: Session, q: Any, limit: int) -> Iterator[list[Checkpoint]]:
    """``q``'s rows, ``limit`` at a time (at most 50 pages: a problems-only view of a healthy
    cluster stops looking after 50 x limit checkpoints and offers the next page)."""
    before = None
    for _ in range(50):
        page = list(s.scalars((q.where(Checkpoint.id < before) if before else q).limit(limit)))
        if not page:
            return
        yield page
        before = page[-1].id


def _matrix(c: Checkpoint, per_worker: dict[str, dict[str, str]], workers: list[str], rf: int, problems_only: bool,
            replica_totals: dict[str, int], shard_totals: dict[str, int]) -> dict[str, Any] | None:
    rows, counts = [], {"healthy": 0, "under-replicated": 0, "lost": 0}
    for f in c.files:
        for sh in f.shards:
            copies = per_worker.get(sh.sha256, {})  # the copy of this content on each worker
            h = shard_health(list(copies.values()), rf, c.local_present)
            counts[h] += 1
            shard_totals[h] = shard_totals.get(h, 0) + 1
            for cell in copies.values():
                replica_totals[cell] = replica_totals.get(cell, 0) + 1
            if problems_only and h == "healthy":
                continue
            rows.append({"label": f"{f.relpath or c.name} #{sh.seq}", "sha256": sh.sha256, "health": h,
                         "cells": [copies.get(w, "") for w in workers]})
    if not rows:
        return None
    worst = checkpoint_health(c.store_state or "unknown", counts)
    return {"id": c.id, "name": c.name, "path": c.path, "run": c.run, "rows": rows, "counts": counts, "health": worst}


def jobs(settings: Settings, *, state: str | None = None, kind: str | None = None, before: int | None = None,
         limit: int = PAGE, search: str | None = None, order: tuple[Any, ...] = (), offset: int = 0) -> list[dict]:
    """One page of jobs, newest first: ids below ``before``. ``search``: a job id (``12`` or
    ``#12``), else text in the checkpoint's path, the error, the reason it waits or the
    parameters (worker, destination), or the start of the content's SHA-256."""
    with session_scope(settings.db_url, readonly=True) as s:
        q = select(Job).order_by(*order, Job.id.desc()).offset(offset).limit(limit)
        if search and search.lstrip("#").isdigit():
            q = q.where(Job.id == int(search.lstrip("#")))
        elif search:
            q = q.outerjoin(Checkpoint, Checkpoint.id == Job.checkpoint_id).where(or_(
                contains(Checkpoint.path, search), contains(Job.last_error, search),
                contains(Job.blocked_reason, search), contains(cast(Job.params, Text), search),
                Job.sha256.startswith(search.lower(), autoescape=True)))
        if before:
            q = q.where(Job.id < before)
        if state:
            q = q.where(Job.state == state)
        if kind:
            q = q.where(Job.kind == kind)
        out = []
        found = list(s.scalars(q))
        took = durations(s, found)
        for j in found:
            d = job_dict(j) | progress_of(j)
            d["duration_s"] = took[j.id]
            d["checkpoint_path"] = j.checkpoint.path if j.checkpoint else None
            d["checkpoint_name"] = j.checkpoint.name if j.checkpoint else None
            d["active"] = j.state in states.ACTIVE[j.kind]
            out.append(d)
        return out


def durations(s: Session, jobs: list[Job]) -> dict[int, float]:
    """Seconds each job worked: until its work ended, else until now. A store job's work ends
    when it is verified (rotating, superseding or forgetting it later is retention, not the
    store); any job's when it comes to rest (``states.RESTING``)."""
    ids = [j.id for j in jobs]
    if not ids:
        return {}
    rest = or_(*(and_(Job.kind == kind, JobEvent.to_state.in_(sorted(st))) for kind, st in states.RESTING.items()))
    moved = and_(JobEvent.job_id.in_(ids), JobEvent.from_state.is_not(None), JobEvent.from_state != JobEvent.to_state)
    q = select(JobEvent.job_id, func.max(JobEvent.at)).join(Job, Job.id == JobEvent.job_id).group_by(JobEvent.job_id)
    verified: dict[int, datetime] = dict(s.execute(q.where(moved, Job.kind == JobKind.STORE,
                                                           JobEvent.to_state == StoreState.VERIFIED)).all())
    rested: dict[int, datetime] = dict(s.execute(q.where(moved, rest)).all())
    t = now()
    return {j.id: ((verified.get(j.id) or rested.get(j.id) or j.finished_at or t) - j.created_at).total_seconds()
            for j in jobs}


def progress_of(j: Job) -> dict[str, Any]:
    """What a job's bytes count, in words: a store job's are the copies it sends (RF of each
    content a worker does not hold yet), shown beside the checkpoint's own size."""
    if j.kind == states.JobKind.STORE:
        source = j.checkpoint.total_bytes if j.checkpoint else None
        return {"bytes_label": "copies sent", "source_bytes": source}
    label = {states.JobKind.RESTORE: "gathered", states.JobKind.SCRUB: "re-hashed",
             states.JobKind.REPAIR: "copied"}.get(states.JobKind(j.kind), "done")
    return {"bytes_label": label, "source_bytes": None}


def job(settings: Settings, job_id: int) -> dict[str, Any]:
    with session_scope(settings.db_url, readonly=True) as s:
        j = s.get(Job, job_id)
        if j is None:
            raise UnknownJob(job_id)
        d = job_dict(j) | progress_of(j)
        d["checkpoint_path"] = j.checkpoint.path if j.checkpoint else None
        d["terminal"] = j.state in states.TERMINAL[j.kind]
        d["resting"] = j.state in states.RESTING[j.kind]
        d["active"] = j.state in states.ACTIVE[j.kind]
        d["duration_s"] = durations(s, [j])[j.id]
        d["timeline"] = [{"at": e.at, "from": e.from_state, "to": e.to_state, "detail": e.detail}
                         for e in s.scalars(select(JobEvent).where(JobEvent.job_id == j.id).order_by(JobEvent.id))]
        return d


def workers(settings: Settings, *, search: str | None = None) -> list[dict[str, Any]]:
    """Every storage worker (the object stores are :func:`storage`'s); ``search``: text in its
    id, address, zone, state or why it is not used."""
    with session_scope(settings.db_url, readonly=True) as s:
        return _workers(s, held_per_worker(s), search)


def storage(settings: Settings, *, search: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both tiers, apart: the storage workers (:func:`workers`) and the object-store targets as
    ``ckpt status`` lists them (pipeline.objectstore.report.targets: id, url, endpoint, state,
    used bytes against the quota, copies, last error), from one grouped count of what each row
    holds; ``search`` also finds a target by its id, url, endpoint, state or last error."""
    with session_scope(settings.db_url, readonly=True) as s:
        held = held_per_worker(s)
        stores = objectstore_report.targets(s, settings, held)
        if search:
            text = search.lower()
            stores = [o for o in stores
                      if any(text in str(o[k] or "").lower() for k in ("id", "url", "endpoint", "state", "last_error"))]
        return _workers(s, held, search), stores


def _workers(s: Session, held: dict[str, tuple[int, int]], search: str | None) -> list[dict[str, Any]]:
    q = select(StorageWorker).where(StorageWorker.tier == Tier.WORKERS).order_by(StorageWorker.id)
    if search:
        q = q.where(or_(*(contains(c, search) for c in (StorageWorker.id, StorageWorker.url, StorageWorker.zone,
                                                         StorageWorker.state, StorageWorker.last_error))))
    return [worker_dict(w) | {"shards": held.get(w.id, (0, 0))[0], "bytes": held.get(w.id, (0, 0))[1]}
            for w in s.scalars(q)]


def dead_letters(settings: Settings, *, search: str | None = None) -> list[dict[str, Any]]:
    """The dead letters; ``search``: text in the message id, actor, arguments or error."""
    # Imported here: importing pipeline.tasks installs the broker from the settings of the moment.
    from pipeline.tasks import deadletters

    letters = deadletters.list_letters(settings)
    if not search:
        return letters
    text = search.lower()
    return [d for d in letters
            if any(text in str(d[k]).lower() for k in ("id", "actor", "args", "kwargs", "error"))]


def recent_transfers(settings: Settings, limit: int = 30) -> list[dict[str, Any]]:
    """Finished stores and restores, oldest first: throughput and time to protection."""
    with session_scope(settings.db_url, readonly=True) as s:
        out = []
        # The newest candidate events by id (the order they were written), from the end of the
        # table: the scan stops early however many events there are.
        recent = (select(JobEvent.job_id, JobEvent.to_state, JobEvent.at)
                  .where(JobEvent.to_state.in_(("verified", "done"))).order_by(JobEvent.id.desc())
                  .limit(limit * 4)).subquery()
        q = (select(Job, recent.c.at).join(recent, recent.c.job_id == Job.id)
             .where(((Job.kind == JobKind.STORE) & (recent.c.to_state == "verified"))
                    | ((Job.kind == JobKind.RESTORE) & (recent.c.to_state == "done")))
             .order_by(recent.c.at.desc()).limit(limit)
             .options(selectinload(Job.checkpoint)))  # one query for their checkpoints, not one each
        for j, at in s.execute(q):
            c = j.checkpoint
            if c is None:
                continue
            started = j.created_at
            seconds = max(1e-3, (at - started).total_seconds())
            written = datetime.fromtimestamp(c.mtime, tz=at.tzinfo) if j.kind == JobKind.STORE else started
            out.append({
                "job_id": j.id, "kind": j.kind, "checkpoint_id": c.id, "bytes": c.total_bytes, "at": at,
                "seconds": seconds, "mb_per_s": c.total_bytes / seconds / 1e6,
                "time_to_protection_s": max(0.0, (at - written).total_seconds()) if j.kind == JobKind.STORE else None,
            })
        return list(reversed(out))


def overview(settings: Settings, dead_letters: int) -> dict[str, Any]:
    """The front page: runs, totals by state, capacity and its history, workers, object stores
    (apart: the cluster's counts are the workers'), transfers.
    Aggregates in SQL: its cost does not grow with the number of checkpoints listed."""
    ws, stores = storage(settings)
    with session_scope(settings.db_url, readonly=True) as s:
        facts = run_facts(s)
        by_state: dict[str, int] = {}
        for f in facts.values():
            for state, n in f["by_state"].items():
                by_state[state] = by_state.get(state, 0) + n
        protected = sum(f["protected_bytes"] for f in facts.values())
        unprotected = sum(f["unprotected_bytes"] for f in facts.values())
        lost = lost_checkpoints(s)
        running = job_lookup.count(s, job_lookup.active_pairs())
        failed = job_lookup.count(s, job_lookup.failed_pairs())
        last_scrub = s.scalar(select(func.max(Job.finished_at)).where(Job.kind == JobKind.SCRUB, Job.state == "done"))
        found_problems = problem_dicts(s)
        waiting = waits.listed(s, now())
        summaries = run_summaries(s, settings, facts=facts)
        usage = capacity.usage(s, settings)
        run_usage = capacity.per_run(s)
        chart = capacity.history(s, limit=400)
    return {
        "runs": summaries, "problems": found_problems, "waiting": waiting, "capacity": usage.as_dict(),
        "run_usage": run_usage,
        "degraded": degraded_runs(settings),
        "capacity_history": chart,
        "vanished_unprotected": by_state.get(StoreState.VANISHED, 0),
        "protected_bytes": protected, "unprotected_bytes": unprotected, "lost_checkpoints": lost,
        "checkpoints_by_state": by_state, "jobs_running": running, "jobs_failed": failed,
        "dead_letters": dead_letters,
        "workers_up": sum(1 for w in ws if w["state"] == WorkerState.UP),
        "workers_down": sum(1 for w in ws if w["state"] not in (WorkerState.UP, WorkerState.FULL)), "workers": ws,
        "objectstores": stores, "objectstores_up": sum(1 for o in stores if o["state"] in states.COUNTING_WORKERS),
        "last_scrub": last_scrub, "next_scrub": next_scrub(settings),
        "transfers": recent_transfers(settings),
    }


def capacity_doc(settings: Settings) -> dict[str, Any]:
    """Cluster usage, per-run usage and the usage history (``/api/capacity``)."""
    with session_scope(settings.db_url, readonly=True) as s:
        return {"capacity": capacity.usage(s, settings).as_dict(), "runs": capacity.per_run(s),
                "history": capacity.history(s, limit=400)}


def next_scrub(settings: Settings) -> datetime | None:
    if not settings.scrub_cron:
        return None
    from apscheduler.triggers.cron import CronTrigger

    t = now()
    return CronTrigger.from_crontab(settings.scrub_cron).get_next_fire_time(None, t + timedelta(seconds=1))


def hosts(settings: Settings) -> list[dict[str, Any]]:
    """Every training host (its id, its hostname as label, when its watcher and its consumer
    last reported in), those a restore may go to first (pipeline/db/hosts.py)."""
    with session_scope(settings.db_url, readonly=True) as s:
        return [dataclasses.asdict(h) for h in db_hosts.listed(s, settings)]


def retention(settings: Settings) -> dict[str, Any]:
    """The GC and retention page: per run its effective remote policy (and where it comes
    from), what the policy would forget now (pipeline.integrity.retention.plan_run, as `ckpt
    policy`) and its pins; what the next collection would free per worker (the collection's
    own dry run, as `ckpt gc --dry-run`); the last collections and what they freed."""
    from pipeline import operations
    from pipeline.integrity import retention as retention_mod

    runs = []
    with session_scope(settings.db_url, readonly=True) as s:
        for name in s.scalars(select(Checkpoint.run).where(Checkpoint.current.is_(True)).distinct()
                              .order_by(Checkpoint.run)):
            pattern, _opts = settings.run_table(name)
            policy = settings.policy_for(name)
            verdicts = retention_mod.plan_run(s, settings, name)
            dropped = [v for v in verdicts if not v.keep]
            pins = checkpoint_rows(s, settings, list(s.scalars(
                select(Checkpoint).where(Checkpoint.run == name, Checkpoint.current.is_(True),
                                         Checkpoint.pinned.is_(True)).order_by(*newest_first()))))
            runs.append({
                "run": name, "policy": policy.describe(), "policy_set": policy.is_set,
                "source": (f'[runs."{pattern}"] (config.toml or CKPT_RUN_OPTIONS)' if pattern else
                           "the global remote_* settings" if policy.is_set else "no rule set anywhere"),
                "local_keep_last": settings.keep_last, "protected": len(verdicts),
                "kept": len(verdicts) - len(dropped), "dropped": [dataclasses.asdict(v) for v in dropped],
                "dropped_bytes": sum(v.bytes for v in dropped),
                "pins": [{"id": p["id"], "name": p["name"], "step": p["step"], "note": p["pin_note"],
                          "state": p["state"]} for p in pins],
            })
        gc_jobs = []
        for j in s.scalars(select(Job).where(Job.kind == JobKind.GC).order_by(Job.id.desc()).limit(10)):
            d = job_dict(j)
            d.update(worker_id=j.params.get("worker_id"), deleted=int(j.params.get("deleted", 0)),
                     freed_bytes=int(j.params.get("bytes", 0)))
            gc_jobs.append(d)
    freed = operations.collect_garbage(settings, dry_run=True).freed
    return {"runs": runs, "next_collection": [dataclasses.asdict(f) for f in freed],
            "next_copies": sum(f.copies for f in freed), "next_bytes": sum(f.bytes for f in freed),
            "gc_jobs": gc_jobs, "grace_seconds": settings.gc_grace_seconds, "gc_cron": settings.gc_cron,
            "local_keep_last": settings.keep_last}
