"""The verify step: ``replicated -> verified``.

Each storage worker re-hashes its replicas from its disk; the answers are compared to the
manifest's SHA-256, never to anything the worker says about itself (docs/design.md, invariant 4).
Replicas already re-hashed and matched during this job (each new copy as soon as it is
stored; the copies it shares with earlier checkpoints by its recheck, beside the uploads) are
not read again; their workers only confirm that they still hold them, so a worker lost since
then is still caught here.
A missing copy is sent again; a corrupt one is replaced on another worker and the job goes
back to ``sharded`` until the replacement is stored. Copies are of content: a copy that a
verify finds damaged is damaged for every checkpoint that shares it.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.core.copies import Need
from pipeline.db import workers
from pipeline.db.content_rf import content_rf
from pipeline.db.copies import just, move, on, place, shas_of
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import note, now, transition
from pipeline.errors import ObjectMismatch, ObjectMissing, ObjectStoreError, PlacementError, WorkerError
from pipeline.integrity.repair import repair_damaged
from pipeline.objectstore.tier import is_target, store_for
from pipeline.settings import Settings
from pipeline.states import CopyState, JobKind, Tier, WorkerState
from pipeline.steps import Send, begin_step
from pipeline.store.replication import fan_in_job

log = logging.getLogger("ckpt.verify")
S = states.StoreState


def copies_of(session: Session, checkpoint_id: int, wanted: Iterable[str]) -> list[ContentCopy]:
    """The copies in ``wanted`` states of every content a checkpoint references."""
    return list(session.scalars(
        select(ContentCopy).where(ContentCopy.sha256.in_(shas_of(checkpoint_id)), ContentCopy.state.in_(sorted(wanted)))
        .order_by(ContentCopy.id)
    ))


@dataclass
class WorkerAsk:
    url: str
    #: shards to re-hash from the disk
    rehash: list[str] = field(default_factory=list)
    #: shards re-hashed when they were stored: only confirm they are still there (name -> size)
    present: dict[str, int] = field(default_factory=dict)
    #: On an object store: each shard's size and the checksum the store keeps for it, which
    #: confirming it compares (the store's own checksum stands for a re-hash).
    expect: dict[str, tuple[int, str | None]] = field(default_factory=dict)


def confirm_on_store(settings: Settings, worker_id: str, expect: dict[str, tuple[int, str | None]]
                     ) -> dict[str, str | None] | str:
    """What an object store's checksums say of its copies, in the form of a worker's re-hash:
    name -> the name (confirmed), None (absent) or what is wrong; the error text if the store
    could not answer."""
    out: dict[str, str | None] = {}
    try:
        store = store_for(settings, worker_id)
        for name, (size, checksum) in sorted(expect.items()):
            try:
                store.confirm(name, size, checksum)
                out[name] = name
            except ObjectMissing:
                out[name] = None
            except ObjectMismatch as exc:
                out[name] = exc.reason
    except ObjectStoreError as exc:
        log.warning("confirming copies on %s failed: %s", worker_id, exc)
        return exc.reason
    return out


def rehash_on_workers(settings: Settings, asks: dict[str, WorkerAsk]) -> dict[str, dict[str, str | None] | str]:
    """Ask each worker to re-hash some of its shards and to confirm that others are held.

    Returns id -> {name: sha256 from the disk (a confirmed one: its own name, or its wrong
    size), or None if absent}, or id -> error text if the worker could not answer.
    """
    key = settings.key()

    def ask(item: tuple[str, WorkerAsk]) -> tuple[str, dict[str, str | None] | str]:
        worker_id, a = item
        if is_target(worker_id):
            return worker_id, confirm_on_store(settings, worker_id, a.expect)
        client = WorkerClient(a.url, key, worker_id)
        try:
            out: dict[str, str | None] = {}
            if a.present:
                sizes = client.stat(sorted(a.present))
                out.update({n: n if sizes.get(n) == size else (None if sizes.get(n) is None
                                                                else f"{sizes[n]:,} bytes, not {size:,}")
                            for n, size in a.present.items()})
            if a.rehash:
                out.update({r["name"]: r["sha256"] for r in client.verify(sorted(set(a.rehash)))})
        except WorkerError as exc:
            log.warning("verify on %s failed: %s", worker_id, exc)
            return worker_id, exc.reason
        return worker_id, out

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(asks)))) as pool:
        return dict(pool.map(ask, asks.items()))


def checked(copies: list[ContentCopy], need: Need) -> list[ContentCopy]:
    """The copies the verify step checks: every one on a worker, and those on object stores
    only when the run requires them (a lagging one is not this step's)."""
    return [cp for cp in copies if need.targets or not is_target(cp.worker_id)]


def replace_copy(session: Session, settings: Settings, cp: ContentCopy, state: str, error: str, *,
                 at: datetime | None = None) -> list[Send]:
    """Stop counting ``cp`` (moved to ``state`` at ``at``) and, if its content is now short of RF,
    place fresh copies on other placeable workers; the messages that send them. With nowhere to
    place one now, the store's next re-drive places it (pipeline.service.scheduler.resume)."""
    move(session, cp, state, at=at, error=error)
    tier = cp.worker.tier
    referencing = select(CheckpointFile.checkpoint_id).join(Shard, Shard.file_id == CheckpointFile.id).where(
        Shard.sha256 == cp.sha256)
    run = session.scalar(select(Checkpoint.run).where(Checkpoint.id.in_(referencing)).limit(1)) or ""
    # The workers' RF of the content (the largest of its runs'), an object store's of a run.
    wanted = content_rf(session, settings, cp.sha256) if tier == Tier.WORKERS else settings.target_policy(run)[0]
    try:
        with session.begin_nested():
            fresh = place(session, cp.content, wanted, tier=tier)
    except PlacementError as exc:
        log.warning("content %s: no worker for a replacement copy yet: %s", cp.sha256[:12], exc)
        # A worker that holds a damaged copy takes no new one: rebuild those in place.
        return repair_damaged(session, settings, just(cp.sha256), f"no worker for a replacement copy: {error}")
    return [Send("replicate", (c.id,)) for c in fresh]


def recheck_shared(settings: Settings, job_id: int) -> list[Send]:
    """Re-hash, while this store's new copies are on their way, the verified copies it did not
    send (content it shares with earlier checkpoints, e.g. a step's unchanged half).

    A match is recorded as a re-hash made during this store (``verified_at``), so the verify
    step only confirms those copies are still held instead of reading them after the last
    upload. Anything else is left as it is: the verify step re-hashes it and decides.
    Sent by the shard step only when it has copies to send (docs/design.md, section 4).
    """
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.state != S.SHARDED or job.checkpoint_id is None:
            return []
        since = job.created_at
        copies = copies_of(s, job.checkpoint_id, {CopyState.VERIFIED})
        asks = _stale(copies, since)
    if asks:
        n = recheck_copies(settings, asks)
        log.info("job %d: %d shared copies re-hashed beside the uploads (%d matched)", job_id,
                 sum(len(a.rehash) for a in asks.values()), n)
    return []


def recheck_contents(settings: Settings, shas: list[str], since: datetime) -> int:
    """The same for contents a store that is still being detected shares (pipeline.store.early):
    their verified copies not re-hashed since ``since`` (when its hashing began) are re-hashed
    now; the copies that matched."""
    with session_scope(settings.db_url) as s:
        copies = list(s.scalars(select(ContentCopy).where(ContentCopy.sha256.in_(shas),
                                                          ContentCopy.state == CopyState.VERIFIED)))
        asks = _stale(copies, since)
    return recheck_copies(settings, asks) if asks else 0


def _stale(copies: list[ContentCopy], since: datetime) -> dict[str, WorkerAsk]:
    """What to ask each worker: its copies among ``copies`` not re-hashed since ``since``."""
    asks: dict[str, WorkerAsk] = {}
    for cp in copies:
        if (cp.verified_at is None or cp.verified_at < since) and not is_target(cp.worker_id):
            asks.setdefault(cp.worker_id, WorkerAsk(cp.worker.url)).rehash.append(cp.sha256)
    return asks


def recheck_copies(settings: Settings, asks: dict[str, WorkerAsk]) -> int:
    """Have the workers re-hash copies; record each match as re-hashed now. How many matched."""
    answers = rehash_on_workers(settings, asks)
    matched_n = 0
    with session_scope(settings.db_url) as s:
        t = now()
        for worker_id, answer in answers.items():
            matched = [name for name, sha in answer.items() if sha == name] if isinstance(answer, dict) else []
            if matched:  # still verified (a verify that found otherwise meanwhile has the last word)
                move(s, on(worker_id, *matched), CopyState.VERIFIED, at=t, from_=(CopyState.VERIFIED,))
                matched_n += len(matched)
    return matched_n


def verify_checkpoint(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = begin_step(s, settings, job_id, S.REPLICATED)
        if job is None:
            return []
        ckpt = one(s, Checkpoint, job.checkpoint_id)
        checkpoint_id, since, need = ckpt.id, job.created_at, settings.need_for(ckpt.run)
        asks: dict[str, WorkerAsk] = {}
        confirmed: set[int] = set()
        beside = 0  # of those, copies stored before this job, re-hashed by its recheck
        for cp in checked(copies_of(s, checkpoint_id, states.SENT), need):
            a = asks.setdefault(cp.worker_id, WorkerAsk(cp.worker.url))
            if is_target(cp.worker_id):
                a.expect[cp.sha256] = (cp.content.size, cp.checksum)
                confirmed.add(cp.id)
            elif cp.state == CopyState.VERIFIED and cp.verified_at is not None and cp.verified_at >= since:
                a.present[cp.sha256] = cp.content.size  # re-hashed since this job started
                confirmed.add(cp.id)
                beside += cp.stored_at is None or cp.stored_at < since
            else:
                a.rehash.append(cp.sha256)

    answers = rehash_on_workers(settings, asks)

    sends: list[Send] = []
    with session_scope(settings.db_url) as s:
        t = now()
        bad: list[str] = []
        waits: list[str] = []
        for worker_id, answer in answers.items():
            if isinstance(answer, str) and not is_target(worker_id):
                workers.observe(s, one(s, StorageWorker, worker_id), WorkerState.DOWN, error=answer)
        for cp in checked(copies_of(s, checkpoint_id, states.SENT), need):
            reply = answers.get(cp.worker_id)
            if reply is None:
                continue  # stored since the question was asked: the next verify sees it
            if isinstance(reply, str) and is_target(cp.worker_id):
                waits.append(reply)  # a store that cannot answer now: nothing is lost, the job waits
                continue
            if isinstance(reply, str):  # unreachable: its copies do not count; copy elsewhere
                sends += replace_copy(s, settings, cp, CopyState.ABANDONED, f"worker unreachable at verify: {reply}")
                bad.append(f"content {cp.sha256[:12]} unreachable on {cp.worker_id}")
                continue
            actual = reply.get(cp.sha256, "absent")
            if actual == "absent":
                continue  # stored since the question was asked
            if actual == cp.sha256:
                # A confirmed copy was re-hashed when it was stored (or by the recheck): that
                # re-hash stands; the others were re-hashed now.
                move(s, cp, CopyState.VERIFIED, at=t, rehashed_at=cp.verified_at if cp.id in confirmed else t)
            elif actual is None:
                move(s, cp, CopyState.PENDING, at=t, error="missing on the worker at verify")
                bad.append(f"content {cp.sha256[:12]} missing on {cp.worker_id}")
                sends.append(Send("replicate", (cp.id,)))
            else:
                sends += replace_copy(s, settings, cp, CopyState.CORRUPT, f"at verify the worker gave {actual}", at=t)
                bad.append(f"content {cp.sha256[:12]} corrupt on {cp.worker_id}")
        if waits and not bad:
            why = f"waiting for the object store: {waits[0]}"
            note(s, job_id, why)
            log.warning("job %d: %s", job_id, why)
            return sends  # still replicated: verified again when its lease ends
        if bad:
            transition(s, job_id, JobKind.STORE, S.REPLICATED, S.SHARDED, lease_seconds=settings.lease_seconds,
                       detail="re-replicating: " + "; ".join(bad[:10]))
            s.flush()
            # Content that still has RF stored copies elsewhere needs nothing sent: fan in now.
            return sends + fan_in_job(s, settings, job_id)
        run = one(s, Checkpoint, checkpoint_id).run
        rehashed_now = sum(len(a.rehash) for a in asks.values())
        transition(s, job_id, JobKind.STORE, S.REPLICATED, S.VERIFIED,
                   detail=f"{len(confirmed) + rehashed_now} copies re-hashed and matched: "
                          f"{len(confirmed) - beside} as they were stored, {beside} shared with earlier "
                          f"checkpoints beside the uploads, {rehashed_now} now")
        log.info("job %d verified on %d workers", job_id, len(asks))
    return [Send("rotate_run", (run,))]
