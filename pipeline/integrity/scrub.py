"""Scrub: one job per storage row (a worker, or an object store) checks its copies against the manifest.

A worker re-hashes from its disk at a bounded read rate; the answers are compared to the
manifest's SHA-256, never to anything the worker says about itself. An object store's copies
are confirmed by the store's checksum and read back at a bounded rate (:func:`read_back_on_store`):
a sample of each object's ranges, or all of it with its SHA-256 checked. The cursor (the last
shard hash checked) is saved in the job after every batch, so a scrub that crashed resumes
where it was. A corrupt or missing copy asks for a repair of its content. A store that cannot
answer now (throttled, unreachable, credentials) marks nothing: the job waits, saying why, and
goes on from its cursor once its lease ends.
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
from pipeline.db.models import Content, ContentCopy, Job, StorageWorker
from pipeline.db.transitions import (
    create_worker_jobs,
    note,
    now,
    renew_lease,
    transition,
)
from pipeline.errors import CkptError, ObjectMismatch, ObjectMissing, ObjectStoreError
from pipeline.integrity.repair import request_repair
from pipeline.leases import leased
from pipeline.objectstore.tier import store_for
from pipeline.settings import Settings
from pipeline.states import HELD, CopyState, JobKind, Tier
from pipeline.steps import Send, start_job

log = logging.getLogger("ckpt.scrub")
C = states.ScrubState


def request_scrub(session: Session, settings: Settings, *, worker_ids: list[str] | None = None,
                  dedupe: str | None = None, reason: str = "requested") -> list[Job]:
    """Create one scrub job per live storage worker and object store (or the named ones); the
    caller sends them. An object store whose scrub still waits for it (throttled, unreachable)
    is given no second one."""
    q = select(StorageWorker).where(StorageWorker.state.in_(sorted(states.SCRUBBED_WORKERS)))
    if worker_ids:
        q = select(StorageWorker).where(StorageWorker.id.in_(worker_ids))
    workers = list(session.scalars(q.order_by(StorageWorker.id)))
    if worker_ids and len(workers) != len(set(worker_ids)):
        missing = sorted(set(worker_ids) - {w.id for w in workers})
        raise CkptError(f"unknown storage worker {', '.join(missing)}; `ckpt status` lists them")
    waiting = {(params or {}).get("worker_id") for params in session.scalars(select(Job.params).where(
        Job.kind == JobKind.SCRUB, Job.state.in_(sorted(states.ACTIVE[JobKind.SCRUB]))))}
    ids = [w.id for w in workers if w.tier == Tier.WORKERS or w.id not in waiting]
    return create_worker_jobs(session, JobKind.SCRUB, ids, {"cursor": "", "checked": 0, "bad": 0},
                              f"scrub of {{worker}} ({reason})", lease_seconds=settings.lease_seconds, dedupe=dedupe)


def scrub(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = start_job(s, settings, job_id, JobKind.SCRUB, C.QUEUED, C.SCRUBBING)
        if job is None:
            return []
        worker_id = job.params["worker_id"]
        worker = one(s, StorageWorker, worker_id)
        on_store = worker.tier == Tier.OBJECT_STORE
        client = None if on_store else WorkerClient(worker.url, settings.key(), worker_id)
        day = job.created_at.toordinal()  # whose turn of whole read-backs this scrub is (an object store's)

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
                expect = _expected(s, worker_id, batch) if on_store else {}
            if client is not None:
                answers, wait = {r["name"]: r for r in client.verify(batch, rate=settings.scrub_rate)}, None
            else:
                answers, wait = read_back_on_store(settings, worker_id, expect, day=day)
            with session_scope(settings.db_url) as s:
                t = now()
                bad = record_rehash(s, worker_id, answers, t)
                for sha in bad:
                    repair = request_repair(s, settings, sha, f"scrub of {worker_id} found its copy bad",
                                            found_by=job_id)
                    if repair is not None:
                        sends.append(Send("repair", (repair.id,)))
                done = [name for name in batch if name in answers]
                params.update(cursor=done[-1] if done else params["cursor"], checked=params["checked"] + len(done),
                              bad=params["bad"] + len(bad))
                read = Job.bytes_done + sum(a["size"] or 0 for a in answers.values())
                if wait is None:
                    renew_lease(s, job_id, settings.lease_seconds, params=params, bytes_done=read, blocked_reason=None)
                    continue
                # Not the copies' fault: nothing is marked, and a wait is no failed attempt (a
                # store throttled for hours must not use them up). Resumed when the lease ends.
                why = f"waiting for the object store: {wait}"[:1000]
                if one(s, Job, job_id).blocked_reason != why:
                    note(s, job_id, why)
                renew_lease(s, job_id, settings.lease_seconds, params=params, bytes_done=read, blocked_reason=why,
                            attempts=0)
                log.warning("scrub of %s waits: %s", worker_id, wait)
                return sends


def _expected(s: Session, worker_id: str, batch: list[str]) -> dict[str, tuple[int, str | None]]:
    """name -> (size, the store's checksum recorded with the copy) of ``batch`` on an object store."""
    rows = s.execute(select(ContentCopy.sha256, Content.size, ContentCopy.checksum)
                     .join(Content, Content.sha256 == ContentCopy.sha256)
                     .where(ContentCopy.worker_id == worker_id, ContentCopy.sha256.in_(batch)))
    return {sha: (int(size), checksum) for sha, size, checksum in rows}


def whole_turn(sha: str, day: int, every: int) -> bool:
    """Whether the scrub of ``day`` reads object ``sha`` back whole: one day in ``every``, by its
    hash, so that each night reads 1/``every`` of a bucket whole (0: never, only the sample)."""
    return every > 0 and int(sha[:8], 16) % every == day % every


def read_back_on_store(settings: Settings, worker_id: str, expect: dict[str, tuple[int, str | None]], *,
                       day: int) -> tuple[dict[str, dict[str, Any]], str | None]:
    """An object store's copies checked in the form of a worker's re-hash answers (name ->
    ``{"name", "sha256", "size"}``: ``sha256`` the name when the store's checksum confirms it and
    its bytes read back, None when absent, else what is wrong, in ``error`` too), in hash order;
    and why the store stopped answering (a fault that waits), or None. Answers before that stand.

    Each copy is confirmed (``HeadObject``: size and the store's checksum, as recorded) and read
    back at ``target_scrub_rate``: ``target_scrub_sample`` of its ranges, or all of it with its
    SHA-256 checked when the sample is 1 or it is the object's turn (:func:`whole_turn`).
    """
    answers: dict[str, dict[str, Any]] = {}
    try:
        store = store_for(settings, worker_id)
        for name, (size, checksum) in sorted(expect.items()):
            whole = settings.target_scrub_sample >= 1 or whole_turn(name, day, settings.target_scrub_full_days)
            try:
                store.confirm(name, size, checksum)
                read = store.read_back(name, size, sample=1.0 if whole else settings.target_scrub_sample,
                                       rate=settings.target_scrub_rate)
                answers[name] = {"name": name, "sha256": name, "size": read}
            except ObjectMissing:
                answers[name] = {"name": name, "sha256": None, "size": 0}
            except ObjectMismatch as exc:
                answers[name] = {"name": name, "sha256": "mismatch", "size": 0, "error": exc.reason}
    except ObjectStoreError as exc:
        if not exc.wait:
            raise
        return answers, str(exc)
    return answers, None


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
            move(s, on(worker_id, name), CopyState.CORRUPT, at=t, from_=HELD,
                 error=answer.get("error") or f"re-hash gave {actual}")
            bad.append(name)
    return bad
