"""Scrub: one job per storage worker re-hashes its replicas and compares them to the manifest.

The worker re-hashes from its disk at a bounded read rate; the answers are compared to the
manifest's SHA-256, never to anything the worker says about itself. The cursor (the last
shard hash checked) is saved in the job after every batch, so a scrub that crashed resumes
where it was. A corrupt or missing replica asks for a repair of its checkpoint.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.copies import move, on, shas_on
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Job, StorageWorker
from pipeline.db.transitions import (
    create_worker_jobs,
    now,
    renew_lease,
    transition,
)
from pipeline.errors import CkptError
from pipeline.integrity.repair import request_repair
from pipeline.leases import leased
from pipeline.settings import Settings
from pipeline.states import HELD, CopyState, JobKind, Tier
from pipeline.steps import Send, start_job

log = logging.getLogger("ckpt.scrub")
C = states.ScrubState


def request_scrub(session: Session, settings: Settings, *, worker_ids: list[str] | None = None,
                  dedupe: str | None = None, reason: str = "requested") -> list[Job]:
    """Create one scrub job per live storage worker (or the named ones); the caller sends them.
    Object stores are not scrubbed by a worker's re-hash (their read-back is not built yet)."""
    q = select(StorageWorker).where(StorageWorker.state.in_(sorted(states.SCRUBBED_WORKERS)),
                                    StorageWorker.tier == Tier.WORKERS)
    if worker_ids:
        q = select(StorageWorker).where(StorageWorker.id.in_(worker_ids), StorageWorker.tier == Tier.WORKERS)
    workers = list(session.scalars(q.order_by(StorageWorker.id)))
    if worker_ids and len(workers) != len(set(worker_ids)):
        missing = sorted(set(worker_ids) - {w.id for w in workers})
        raise CkptError(f"unknown storage worker {', '.join(missing)}; `ckpt status` lists them")
    return create_worker_jobs(session, JobKind.SCRUB, [w.id for w in workers], {"cursor": "", "checked": 0, "bad": 0},
                              f"scrub of {{worker}} ({reason})", lease_seconds=settings.lease_seconds, dedupe=dedupe)


def scrub(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = start_job(s, settings, job_id, JobKind.SCRUB, C.QUEUED, C.SCRUBBING)
        if job is None:
            return []
        worker_id = job.params["worker_id"]
        worker = one(s, StorageWorker, worker_id)
        client = WorkerClient(worker.url, settings.key(), worker_id)

    # A batch can outlast the lease (a throttled re-hash, a slow link): kept by time meanwhile.
    with leased(settings, [job_id]):
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
                for sha in bad:
                    repair = request_repair(s, settings, sha, f"scrub of {worker_id} found its copy bad",
                                            found_by=job_id)
                    if repair is not None:
                        sends.append(Send("repair", (repair.id,)))
                params.update(cursor=batch[-1], checked=params["checked"] + len(batch), bad=params["bad"] + len(bad))
                renew_lease(s, job_id, settings.lease_seconds, params=params,
                            bytes_done=Job.bytes_done + sum(a["size"] or 0 for a in answers.values()))


def record_rehash(s: Session, worker_id: str, answers: dict[str, dict[str, Any]], t: datetime) -> list[str]:
    """Record a worker's re-hash answers against each content's SHA-256; the hashes that are bad.

    The matches (nearly all of them) are recorded in a few bulk updates: a reconcile of a
    worker holding millions of shards records a page at a time, not a row at a time.
    """
    bad = []
    good = [name for name, answer in answers.items() if answer.get("sha256") == name]  # the name is the SHA-256
    for i in range(0, len(good), 500):
        move(s, on(worker_id, *good[i:i + 500]), CopyState.VERIFIED, at=t, from_=HELD)
    for name, answer in answers.items():
        actual = answer.get("sha256")
        if actual == name:
            continue
        if actual is None:
            move(s, on(worker_id, name), CopyState.MISSING, at=t, from_=HELD, error="absent at scrub")
            bad.append(name)
        else:
            move(s, on(worker_id, name), CopyState.CORRUPT, at=t, from_=HELD, error=f"re-hash gave {actual}")
            bad.append(name)
    return bad
