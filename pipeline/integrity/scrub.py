"""Scrub: one job per storage worker re-hashes its replicas and compares them to the manifest.

The worker re-hashes from its disk at a bounded read rate; the answers are compared to the
manifest's SHA-256, never to anything the worker says about itself. The cursor (the last
shard hash checked) is saved in the job after every batch, so a scrub that crashed resumes
where it was. A corrupt or missing replica asks for a repair of its checkpoint.
"""
from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.engine import one, session_scope
from pipeline.db.models import CheckpointFile, Job, Replica, Shard, StorageWorker
from pipeline.db.replicas import HELD, mark, shas_on
from pipeline.db.transitions import (
    create_job,
    create_job_once,
    now,
    renew_lease,
    transition,
)
from pipeline.errors import CkptError
from pipeline.integrity.repair import request_repair
from pipeline.settings import Settings
from pipeline.states import JobKind, ReplicaState
from pipeline.steps import Send, start_job

log = logging.getLogger("ckpt.scrub")
C = states.ScrubState


def request_scrub(session: Session, settings: Settings, *, worker_ids: list[str] | None = None,
                  dedupe: str | None = None, reason: str = "requested") -> list[Job]:
    """Create one scrub job per live storage worker (or the named ones); the caller sends them."""
    q = select(StorageWorker).where(StorageWorker.state.in_(sorted(states.SCRUBBED_WORKERS)))
    if worker_ids:
        q = select(StorageWorker).where(StorageWorker.id.in_(worker_ids))
    workers = list(session.scalars(q.order_by(StorageWorker.id)))
    if worker_ids and len(workers) != len(set(worker_ids)):
        missing = sorted(set(worker_ids) - {w.id for w in workers})
        raise CkptError(f"unknown storage worker {', '.join(missing)}; `ckpt status` lists them")
    jobs = []
    for w in workers:
        params = {"worker_id": w.id, "cursor": "", "checked": 0, "bad": 0}
        detail = f"scrub of {w.id} ({reason})"
        job = (create_job_once(session, JobKind.SCRUB, f"{dedupe}:{w.id}", checkpoint_id=None, params=params,
                               lease_seconds=settings.lease_seconds, detail=detail) if dedupe
               else create_job(session, JobKind.SCRUB, checkpoint_id=None, params=params,
                               lease_seconds=settings.lease_seconds, detail=detail))
        if job is not None:
            jobs.append(job)
    return jobs


def scrub(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = start_job(s, settings, job_id, JobKind.SCRUB, C.QUEUED, C.SCRUBBING)
        if job is None:
            return []
        worker_id = job.params["worker_id"]
        worker = one(s, StorageWorker, worker_id)
        client = WorkerClient(worker.url, settings.key())

    sends: list[Send] = []
    while True:
        with session_scope(settings.db_url) as s:
            params = dict(one(s, Job, job_id).params)
            batch = shas_on(s, worker_id, HELD, after=params["cursor"], limit=settings.scrub_batch)
            if not batch:
                transition(s, job_id, JobKind.SCRUB, C.SCRUBBING, C.DONE,
                           detail=f"{params['checked']} shards checked, {params['bad']} bad")
                log.info("scrub of %s done: %d checked, %d bad", worker_id, params["checked"], params["bad"])
                return sends
        answers = {r["name"]: r for r in client.verify(batch, rate=settings.scrub_rate)}
        with session_scope(settings.db_url) as s:
            t = now()
            bad = record_rehash(s, worker_id, answers, t)
            for checkpoint_id in checkpoints_of(s, worker_id, bad):
                repair = request_repair(s, settings, checkpoint_id, f"scrub of {worker_id} found bad replicas")
                if repair is not None:
                    sends.append(Send("repair", (repair.id,)))
            params.update(cursor=batch[-1], checked=params["checked"] + len(batch), bad=params["bad"] + len(bad))
            renew_lease(s, job_id, settings.lease_seconds, params=params,
                        bytes_done=Job.bytes_done + sum(a["size"] or 0 for a in answers.values()))


def record_rehash(s: Session, worker_id: str, answers: dict[str, dict], t: datetime) -> list[str]:
    """Record a worker's re-hash answers against the manifest; the hashes that are bad."""
    bad = []
    for name, answer in answers.items():
        actual = answer.get("sha256")
        if actual == name:  # the name is the manifest's SHA-256 of the shard
            mark(s, worker_id, name, verified_at=t, checked_at=t, state=ReplicaState.VERIFIED, last_error=None)
        elif actual is None:
            mark(s, worker_id, name, checked_at=t, state=ReplicaState.MISSING, last_error="absent at scrub")
            bad.append(name)
        else:
            mark(s, worker_id, name, checked_at=t, state=ReplicaState.CORRUPT, last_error=f"re-hash gave {actual}")
            bad.append(name)
    return bad


def checkpoints_of(s: Session, worker_id: str, shas: list[str]) -> list[int]:
    if not shas:
        return []
    return list(s.scalars(
        select(CheckpointFile.checkpoint_id).join(Shard).join(Replica)
        .where(Replica.worker_id == worker_id, Shard.sha256.in_(shas)).distinct()
    ))
