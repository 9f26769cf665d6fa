"""Garbage collection: content that no kept checkpoint references is deleted from every worker.

**Mark** (:func:`condemn`, one transaction): a live content is condemned when no checkpoint
that still holds its content (``released_at`` is null: not superseded, vanished or
forgotten) references it, and nothing referenced or released it for the grace period. Each
content's row is locked and the references are counted again under the lock, and the
catalog locks the same row (pipeline.detection.catalog._reference) when a store references
it: a store deduplicating onto a content at the same moment either commits first (the mark
sees its reference and keeps the content) or finds it condemned and revives it
(pipeline.store.sharding.revive). A condemned content's copies never count
(pipeline.core.copies), so nothing is ever protected by a copy about to go.

**Sweep** (:func:`collect`, one job per worker, throttled, resumable from a cursor): under the
contents' row locks, the worker's copies of content still condemned are marked ``deleting``
(committed), deleted on the worker, then forgotten; a content with no copy left is
``deleted``. A revival takes the same lock, so a copy is either marked before it (and replaced)
or never (and counts again). A worker that is down is skipped; its reconcile deletes its
copies of condemned content when it returns (pipeline.integrity.reconcile). docs/design.md,
section 5, has the argument in full.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Exists, Select, delete, func, select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db.copies import move, on
from pipeline.db.engine import one, session_scope
from pipeline.db.models import (
    Checkpoint,
    CheckpointFile,
    CheckpointPart,
    Content,
    ContentCopy,
    Job,
    Shard,
    StorageWorker,
)
from pipeline.db.transitions import create_worker_jobs, note, now, renew_lease, transition
from pipeline.errors import CkptError, ObjectStoreError, WorkerError
from pipeline.leases import leased
from pipeline.objectstore.tier import TargetClient, client_for, is_target
from pipeline.settings import Settings
from pipeline.states import ContentState, CopyState, JobKind, Tier
from pipeline.steps import Send, start_job

log = logging.getLogger("ckpt.gc")
G = states.GcState
#: Contents condemned per mark transaction (a mark over millions runs in several).
MARK_BATCH = 5000


def kept_reference() -> Exists:
    """SQL: some checkpoint that still holds its content references ``Content``: one not
    released, or one forgotten whose local copy (or another host's part of it) is still on disk (the local
    policy deletes that copy only while RF good copies exist elsewhere: invariant 1; its
    content goes once it has)."""
    forgotten = Checkpoint.store_state == states.StoreState.FORGOTTEN.value
    part_left = select(CheckpointPart.id).where(CheckpointPart.checkpoint_id == Checkpoint.id,
                                                CheckpointPart.local_present.is_(True)).exists()
    holds = Checkpoint.released_at.is_(None) | (forgotten & (Checkpoint.local_present.is_(True) | part_left))
    return (select(Shard.id).join(CheckpointFile, CheckpointFile.id == Shard.file_id)
            .join(Checkpoint, Checkpoint.id == CheckpointFile.checkpoint_id)
            .where(Shard.sha256 == Content.sha256, holds).exists())


def garbage_query(settings: Settings) -> Select[Any]:
    """SQL: live contents no kept checkpoint references, past the grace period."""
    cutoff = now() - timedelta(seconds=settings.gc_grace_seconds)
    return select(Content.sha256).where(Content.state == ContentState.LIVE, Content.last_referenced_at < cutoff,
                                        ~kept_reference())


def garbage(session: Session, settings: Settings, limit: int | None = None) -> list[str]:
    """Live contents no kept checkpoint references, past the grace period (in hash order)."""
    q = garbage_query(settings).order_by(Content.sha256)
    return list(session.scalars(q.limit(limit) if limit else q))


def mark(settings: Settings) -> tuple[int, int]:
    """Mark all garbage, a batch per transaction (the write lock is never held long);
    ``(contents, bytes)`` condemned."""
    n = size = 0
    while True:
        with session_scope(settings.db_url) as s:
            more, more_size, seen = condemn(s, settings)
        n, size = n + more, size + more_size
        if seen < MARK_BATCH:
            return n, size


def condemn(session: Session, settings: Settings) -> tuple[int, int, int]:
    """Mark one batch: condemn garbage (locked, re-checked); ``(contents, bytes, candidates)``."""
    n = size = 0
    t = now()
    candidates = garbage(session, settings, MARK_BATCH)
    if not candidates:
        return 0, 0, 0
    cutoff = t - timedelta(seconds=settings.gc_grace_seconds)
    locked = session.scalars(select(Content).where(Content.sha256.in_(candidates)).order_by(Content.sha256)
                            .with_for_update())
    for content in locked:
        # Again, under the lock: a store may have referenced it since the query above.
        still = session.scalar(select(~kept_reference()).where(Content.sha256 == content.sha256))
        if content.state != ContentState.LIVE or content.last_referenced_at >= cutoff or not still:
            continue
        content.state, content.condemned_at = ContentState.CONDEMNED, t
        if not content.copies:
            content.state = ContentState.DELETED
        n, size = n + 1, size + content.size
    return n, size, len(candidates)


@dataclass(frozen=True)
class Freed:
    """What a collection frees (or would free) on one worker."""

    worker_id: str
    state: str
    copies: int
    bytes: int


def preview(session: Session, settings: Settings) -> list[Freed]:
    """Per worker, what a collection now would delete: condemned content and garbage past its grace."""
    doomed = select(Content.sha256).where((Content.state == ContentState.CONDEMNED)
                                          | Content.sha256.in_(garbage_query(settings)))
    rows = session.execute(
        select(StorageWorker.id, StorageWorker.state, func.count(ContentCopy.id),
               func.coalesce(func.sum(Content.size), 0))
        .join(ContentCopy, ContentCopy.worker_id == StorageWorker.id)
        .join(Content, Content.sha256 == ContentCopy.sha256)
        .where(ContentCopy.sha256.in_(doomed), ContentCopy.state.not_in((CopyState.PENDING,)))
        .group_by(StorageWorker.id, StorageWorker.state).order_by(StorageWorker.id)
    ).all()
    return [Freed(w, st, int(n), int(b)) for w, st, n, b in rows]


def request_gc(session: Session, settings: Settings, *, worker_ids: list[str] | None = None,
               dedupe: str | None = None, reason: str = "requested") -> list[Job]:
    """One collection job per worker holding copies of condemned content (run :func:`mark` first),
    and per object store that holds some or answers (its orphans are found by listing it)."""
    holders = select(ContentCopy.worker_id).join(Content, Content.sha256 == ContentCopy.sha256).where(
        Content.state == ContentState.CONDEMNED).distinct()
    listable = (StorageWorker.tier == Tier.OBJECT_STORE) & StorageWorker.state.in_(sorted(states.READABLE_WORKERS))
    q = select(StorageWorker.id).where(StorageWorker.id.in_(holders) | listable)
    if worker_ids:
        unknown = sorted(set(worker_ids) - set(session.scalars(select(StorageWorker.id)
                                                               .where(StorageWorker.id.in_(worker_ids)))))
        if unknown:
            raise CkptError(f"unknown storage worker {', '.join(unknown)}; `ckpt status` lists them")
        q = q.where(StorageWorker.id.in_(worker_ids))
    return create_worker_jobs(session, JobKind.GC, list(session.scalars(q.order_by(StorageWorker.id))),
                              {"cursor": "", "deleted": 0, "bytes": 0}, f"collection on {{worker}} ({reason})",
                              lease_seconds=settings.lease_seconds, dedupe=dedupe)


def copy_deleted(session: Session, worker_id: str, sha: str) -> None:
    """A ``deleting`` copy is gone from its worker: forget it; condemned content is deleted once
    it has no copy left."""
    session.execute(delete(ContentCopy).where(ContentCopy.worker_id == worker_id, ContentCopy.sha256 == sha,
                                              ContentCopy.state == CopyState.DELETING)
                    .execution_options(synchronize_session=False))
    content = session.get(Content, sha, populate_existing=True)
    if content is not None and content.state == ContentState.CONDEMNED and not session.scalar(
            select(ContentCopy.id).where(ContentCopy.sha256 == sha).limit(1)):
        content.state = ContentState.DELETED


def collect(settings: Settings, job_id: int) -> list[Send]:
    """Sweep one storage row: delete its copies of condemned content, a batch at a time,
    throttled; on an object store, then its orphans (pipeline.objectstore.orphans)."""
    from pipeline.objectstore import orphans  # it uses this module's copy_deleted and pace

    with session_scope(settings.db_url) as s:
        job = start_job(s, settings, job_id, JobKind.GC, G.QUEUED, G.COLLECTING)
        if job is None:
            return []
        worker = one(s, StorageWorker, job.params["worker_id"])
        worker_id, url = worker.id, worker.url
        if worker.state not in states.READABLE_WORKERS:
            later = ("the next collection deletes its garbage once it answers" if is_target(worker_id)
                     else "it deletes its garbage when it comes back")
            transition(s, job_id, JobKind.GC, G.COLLECTING, G.DONE, detail=f"{worker_id} is {worker.state}: {later}")
            return []
    try:
        client = client_for(settings, worker_id, url)
    except ObjectStoreError as exc:  # a target no longer configured: its copies stay recorded
        with session_scope(settings.db_url) as s:
            transition(s, job_id, JobKind.GC, G.COLLECTING, G.DONE, detail=str(exc))
        return []
    # A batch can outlast the lease (a throttled re-hash, a slow link): kept by time meanwhile.
    with leased(settings, [job_id]):
        try:
            params = sweep(settings, job_id, worker_id, client)
            if params is not None and isinstance(client, TargetClient):
                params = orphans.sweep(settings, job_id, worker_id, client.store, params)
        except ObjectStoreError as exc:
            if not exc.wait:
                raise
            # Throttled, unreachable, credentials: nothing is marked; the lease ends and the
            # scheduler drives the job again from its cursor.
            with session_scope(settings.db_url) as s:
                note(s, job_id, f"waits for its object store: {exc}")
            log.warning("collection on %s waits: %s", worker_id, exc)
            return []
    if params is None:
        return []
    with session_scope(settings.db_url) as s:
        orphaned = f", {params['orphans']} orphan objects" if params.get("orphans") else ""
        transition(s, job_id, JobKind.GC, G.COLLECTING, G.DONE,
                   detail=f"{params['deleted']} copies deleted{orphaned}, {params['bytes'] / 1e9:,.2f} GB freed")
    log.info("collection on %s done: %d copies, %d bytes", worker_id, params["deleted"], params["bytes"])
    return []


def sweep(settings: Settings, job_id: int, worker_id: str,
          client: WorkerClient | TargetClient) -> dict[str, Any] | None:
    """Delete ``worker_id``'s copies of condemned content from the job's cursor on; its params
    once none is left, None when the worker stopped answering (the job is done: its reconcile
    finishes it). On an object store, copies already ``deleting`` go too (a killed orphan pass,
    a revived content's marked copies: no row that is ``deleting`` is ever used again)."""
    doomed = Content.state == ContentState.CONDEMNED
    if is_target(worker_id):
        doomed = doomed | (ContentCopy.state == CopyState.DELETING)
    started = time.monotonic()
    while True:
        with session_scope(settings.db_url) as s:
            params = dict(one(s, Job, job_id).params)
            rows = s.execute(
                select(ContentCopy.sha256, Content.size, ContentCopy.state)
                .join(Content, Content.sha256 == ContentCopy.sha256)
                .where(ContentCopy.worker_id == worker_id, doomed, ContentCopy.sha256 > params["cursor"])
                .order_by(ContentCopy.sha256).limit(settings.gc_batch)
            ).all()
            if not rows:
                return params
            # Under the contents' row locks, still condemned: a store that revived one (the
            # shard step, under the same lock) keeps every copy not marked before it.
            marked = {sha for sha, _size, state in rows if state == CopyState.DELETING}
            names = sorted(marked | set(s.scalars(select(Content.sha256).where(
                Content.sha256.in_([sha for sha, _size, _state in rows]), Content.state == ContentState.CONDEMNED)
                .order_by(Content.sha256).with_for_update())))
            move(s, on(worker_id, *names), CopyState.DELETING)
            sizes = {sha: size for sha, size, _state in rows}
            batch_end = max(sizes)
        try:
            if names:
                client.delete_many(names)
        except WorkerError as exc:
            if exc.status is None:  # gone meanwhile: its reconcile finishes the job when it returns
                with session_scope(settings.db_url) as s:
                    transition(s, job_id, JobKind.GC, G.COLLECTING, G.DONE,
                               detail=f"{worker_id} stopped answering ({exc.reason}); the rest is deleted when it "
                                      "comes back")
                return None
            raise
        with session_scope(settings.db_url) as s:
            for sha in names:
                copy_deleted(s, worker_id, sha)
            params.update(cursor=batch_end, deleted=params["deleted"] + len(names),
                          bytes=params["bytes"] + sum(sizes[sha] for sha in names))
            renew_lease(s, job_id, settings.lease_seconds, params=params, bytes_done=params["bytes"])
        pace(settings, params["deleted"], started)


def pace(settings: Settings, deleted: int, started: float) -> None:
    """Sleep as long as ``deleted`` deletions since ``started`` (monotonic) are ahead of
    ``gc_rate`` per second: a collection never starves the worker's disk or the store."""
    if settings.gc_rate:
        ahead = deleted / settings.gc_rate - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


def send_for(jobs: list[Job]) -> list[Send]:
    return send_for_ids([j.id for j in jobs])


def send_for_ids(job_ids: list[int]) -> list[Send]:
    return [Send("gc", (job_id,)) for job_id in job_ids]
