"""Reconciling a storage worker that came back: what it holds is checked before it counts.

A reconcile is a job (one active per worker) that pages through the worker's inventory in
hash order from a cursor saved after every page, so a worker holding millions of shards
returns to service and a reconcile killed anywhere resumes where it was. Per page:

- copies the control plane expects there are re-hashed (throttled, in batches) and count
  again if they match; expected copies the worker does not hold are ``missing`` and their
  content is repaired;
- files of content that is being garbage-collected (or whose copy there was trimmed) are
  deleted: garbage collection ends on a worker that was down while it ran;
- any other file the worker holds that nothing expects there, or that hashes wrong, is
  quarantined (set aside, not deleted);
- a copy that is surplus (its content has more than RF good copies) is trimmed, decided
  with the content's row locked so two reconciles never both trim the same content.
"""
from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.content_rf import run_rf
from pipeline.db.copies import good_count, good_counts, move, on
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Content, ContentCopy, Job, StorageWorker
from pipeline.db.transitions import create_job, now, renew_lease, transition
from pipeline.integrity.gc import copy_deleted
from pipeline.integrity.repair import request_repair
from pipeline.integrity.scrub import record_rehash
from pipeline.leases import leased
from pipeline.settings import Settings
from pipeline.states import ContentState, CopyState, JobKind
from pipeline.steps import Send, start_job

log = logging.getLogger("ckpt.reconcile")
Q = states.ReconcileState
#: Names per inventory page.
PAGE = 1000


def request_reconcile(session: Session, settings: Settings, worker_id: str, reason: str) -> Job | None:
    """A reconcile job for ``worker_id`` unless one is already active."""
    for job in session.scalars(select(Job).where(Job.kind == JobKind.RECONCILE,
                                                 Job.state.in_(sorted(states.ACTIVE[JobKind.RECONCILE])))):
        if job.params.get("worker_id") == worker_id:
            return None
    params = {"worker_id": worker_id, "cursor": "", "held": 0, "matched": 0, "bad": 0, "unknown": 0,
              "trimmed": 0, "deleted": 0}
    return create_job(session, JobKind.RECONCILE, checkpoint_id=None, params=params,
                      lease_seconds=settings.lease_seconds, detail=f"reconcile of {worker_id} ({reason})")


def reconcile(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = start_job(s, settings, job_id, JobKind.RECONCILE, Q.QUEUED, Q.RECONCILING)
        if job is None:
            return []
        worker_id = job.params["worker_id"]
        worker = one(s, StorageWorker, worker_id)
        if worker.state not in states.READABLE_WORKERS:
            transition(s, job_id, JobKind.RECONCILE, Q.RECONCILING, Q.DONE, detail=f"{worker_id} is {worker.state}")
            return []
        client = WorkerClient(worker.url, settings.key(), worker_id)

    # A batch can outlast the lease (a throttled re-hash, a slow link): kept by time meanwhile.
    with leased(settings, [job_id]):
        sends: list[Send] = []
        while True:
            with session_scope(settings.db_url) as s:
                params = dict(one(s, Job, job_id).params)
            cursor = params["cursor"]
            page = client.inventory_page(after=cursor, limit=PAGE)
            end = page[-1][0] if page else None  # None: the inventory is over
            with session_scope(settings.db_url) as s:
                q = (select(ContentCopy.sha256, ContentCopy.state, Content.state)
                     .join(Content, Content.sha256 == ContentCopy.sha256)
                     .where(ContentCopy.worker_id == worker_id, ContentCopy.sha256 > cursor))
                if end is not None:
                    q = q.where(ContentCopy.sha256 <= end)
                rows = {sha: (state, cstate) for sha, state, cstate in s.execute(q)}
            held = {name for name, _size in page}
            expected = {sha for sha, (state, cstate) in rows.items()
                        if state in states.EXPECTED and cstate == ContentState.LIVE}
            garbage = sorted(sha for sha in held if sha in rows and sha not in expected)
            unknown = sorted(held - set(rows))
            check = sorted(held & expected)
            answers: dict[str, dict[str, Any]] = {}
            for i in range(0, len(check), settings.scrub_batch):
                batch = check[i:i + settings.scrub_batch]
                answers.update({r["name"]: r for r in client.verify(batch, rate=settings.scrub_rate)})
                with session_scope(settings.db_url) as s:
                    renew_lease(s, job_id, settings.lease_seconds)
            absent = sorted(expected - held)
            with session_scope(settings.db_url) as s:
                t = now()
                bad = record_rehash(s, worker_id, answers, t)
                for sha in absent:
                    move(s, on(worker_id, sha), CopyState.MISSING, at=t, from_=states.SENT,
                         error="absent when the worker came back")
                for sha in bad + absent:
                    repair = request_repair(s, settings, sha, f"{worker_id} came back without a good copy",
                                            found_by=job_id)
                    if repair is not None:
                        sends.append(Send("repair", (repair.id,)))
                corrupt = [n for n in bad if answers[n]["sha256"] is not None]
                # Counted for the whole page first; only the few above RF are decided one by one.
                counts = good_counts(s, check)
                rf = run_rf(s, settings).of(s, [n for n in check if counts.get(n, 0) > 1])  # RF >= 1
                surplus = [n for n in check if n not in bad and counts.get(n, 0) > rf.get(n, settings.rf)
                           and _trim_if_surplus(s, worker_id, n, rf[n])]
                # Decided under the contents' row locks (as the collection's sweep does): every row
                # of condemned content goes; of live content only a retired row (not one placement
                # reused for a new upload meanwhile).
                now_state = dict(s.execute(select(Content.sha256, Content.state).where(Content.sha256.in_(garbage))
                                           .order_by(Content.sha256).with_for_update()).all())
                garbage = [sha for sha in garbage
                           if move(s, on(worker_id, sha), CopyState.DELETING,
                                   from_=None if now_state.get(sha) == ContentState.CONDEMNED
                                   else states.REUSABLE | {CopyState.DELETING.value}) == 1]
            if unknown or corrupt:
                client.quarantine(unknown + corrupt)
            for name in surplus + garbage:
                client.delete(name)
            with session_scope(settings.db_url) as s:
                for sha in surplus + garbage:
                    copy_deleted(s, worker_id, sha)
                params.update(cursor=end if end is not None else cursor, held=params["held"] + len(held),
                              matched=params["matched"] + len(check) - len(bad),
                              bad=params["bad"] + len(bad) + len(absent),
                              unknown=params["unknown"] + len(unknown), trimmed=params["trimmed"] + len(surplus),
                              deleted=params["deleted"] + len(garbage))
                if end is None:
                    detail = (f"{params['held']} held: {params['matched']} matched, {params['bad']} bad or absent, "
                              f"{params['unknown']} unknown quarantined, {params['trimmed']} surplus trimmed, "
                              f"{params['deleted']} garbage deleted")
                    transition(s, job_id, JobKind.RECONCILE, Q.RECONCILING, Q.DONE, detail=detail, params=params)
                    log.info("reconciled %s: %s", worker_id, detail)
                    return sends
                renew_lease(s, job_id, settings.lease_seconds, params=params)


def _trim_if_surplus(s: Session, worker_id: str, sha: str, rf: int) -> bool:
    """Trim this worker's copy if the content keeps more than RF good copies without it.

    The content's row is locked first (PostgreSQL; SQLite has one writer): two reconciles of
    two workers holding the same surplus content decide one after the other, and the second
    sees the first's trim.
    """
    content = s.scalar(select(Content).where(Content.sha256 == sha).with_for_update())
    if content is None or content.state != ContentState.LIVE or good_count(s, sha) <= rf:
        return False
    # ``deleting`` (not ``trimmed``) until the file is gone: placement never reuses the row of
    # a file about to be deleted.
    return move(s, on(worker_id, sha), CopyState.DELETING, from_=(CopyState.VERIFIED,),
                error="surplus copy trimmed") == 1

