"""The replicate step: one copy of one content onto one storage worker, then fan-in.

A copy is of a content, not of one checkpoint's shard: every store that references the
content waits for the same copies. The bytes come from a local file that holds the content
(pipeline.store.source), the store that needs them first. Once stored, the worker re-hashes
the copy from its disk (page cache dropped) and the answer is compared to the content's
SHA-256: a match makes the copy ``verified`` here, so the verify step only has to confirm it.

Fan-in is decided in the database: every store job waiting in ``sharded`` for this content
moves to ``replicated`` (compare-and-set, exactly once) when each of its contents has RF
copies stored on counting workers. A worker that cannot be reached, or stalls (no byte moved
for ``CKPT_STALL_SECONDS``), is marked down, one that answers 507 full; the copy is abandoned for
one on another worker. Through a chain, the hop a worker before it names as stalled,
unreachable or full is the one marked (blame by evidence), never the first hop for it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from pipeline import failpoints, states
from pipeline.capacity import capacity_reason
from pipeline.cluster.client import WorkerClient
from pipeline.db import workers
from pipeline.db.content_rf import content_rf
from pipeline.db.copies import move, place_one
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import note, now, renew_lease, transition
from pipeline.deliveries import still_keyed
from pipeline.errors import AttemptsExhausted, PlacementError, WorkerError
from pipeline.leases import leased
from pipeline.settings import Settings
from pipeline.states import COUNTING_WORKERS, ContentState, CopyState, JobKind, Tier, WorkerState
from pipeline.steps import Send
from pipeline.store.source import Source, local_source, named_source, shard_prefix, source_matches

log = logging.getLogger("ckpt.replicate")
S = states.StoreState


def waiting_jobs(session: Session, sha: str, state: str = S.SHARDED) -> list[Job]:
    """The store jobs in ``state`` (by default waiting for copies) whose checkpoint references
    content ``sha``."""
    referencing = (select(CheckpointFile.checkpoint_id).join(Shard, Shard.file_id == CheckpointFile.id)
                   .where(Shard.sha256 == sha))
    return list(session.scalars(
        select(Job).where(Job.checkpoint_id.in_(referencing), Job.kind == JobKind.STORE, Job.state == state)
        .order_by(Job.id)
    ))


def replicate(settings: Settings, copy_id: int, chain: Sequence[int] = (),
              named: dict[str, Any] | None = None, *, key: str | None = None) -> list[Send]:
    """Send copy ``copy_id``; with ``chain`` (chain replication), the copies of the same content
    on the workers after it too, through it: this host sends the bytes once. ``named``: the
    shard of a local file that holds the bytes, when detection sent this before recording
    the checkpoint (pipeline.store.early); a recorded local file is preferred. ``key``: the
    delivery's message id; a copy of the chain sent since by another message is left to it
    (pipeline/deliveries.py)."""
    with session_scope(settings.db_url) as s:
        rows = {c.id: c for c in s.scalars(select(ContentCopy).where(ContentCopy.id.in_([copy_id, *chain])))}
        if copy_id not in rows:
            return []
        pending = still_keyed([rows[i] for i in (copy_id, *chain) if i in rows
                               and rows[i].state == CopyState.PENDING], key)
        if not pending:
            return fan_in(s, settings, rows[copy_id].sha256)
        cp, rest = pending[0], pending[1:]  # a retry whose first copy was stored goes on from the next
        if cp.content.state != ContentState.LIVE:
            return []  # condemned meanwhile: a store that references it again revives it
        for c in pending:  # each is sent: through the first, or the first itself
            c.attempts += 1
            # Being sent now: the scheduler's object-store sweep does not send it again meanwhile.
            c.sent_at = now()
        if cp.attempts > settings.max_attempts:
            raise AttemptsExhausted(f"copy {cp.id} of {cp.sha256[:12]} on {cp.worker_id}", cp.attempts - 1,
                                    cp.last_error)
        waiting = [job.id for job in waiting_jobs(s, cp.sha256)]
        # A store recorded while this was sent during its hashing (pipeline.store.early) keeps its
        # lease too, until its shard step has run: re-driven, that step would send it again.
        waiting += [job.id for job in waiting_jobs(s, cp.sha256, S.DETECTED)]
        for job_id in waiting:
            renew_lease(s, job_id, settings.lease_seconds)
        src = local_source(s, cp.sha256, settings.host_id) or named_source(named)
        sha, size, worker_id, url = cp.sha256, cp.content.size, cp.worker_id, cp.worker.url
        peers = [] if src is not None else [
            (c.worker.url, c.worker_id) for c in cp.content.copies
            if c.state == CopyState.VERIFIED and c.worker.state in states.READABLE_WORKERS
            and c.worker.tier == Tier.WORKERS]
        hops = [Hop(c.id, c.worker_id, c.worker.url) for c in rest]
        to_store = cp.worker.tier == Tier.OBJECT_STORE
        if to_store:  # a worker's copy is put by the worker itself when it can (the trainer's link once)
            peers = [(c.worker.url, c.worker_id) for c in cp.content.copies
                     if c.state == CopyState.VERIFIED and c.worker.state in states.READABLE_WORKERS
                     and c.worker.tier == Tier.WORKERS]

    if to_store:  # an object store: never in a chain (pipeline.store.sharding.replicate_sends)
        from pipeline.store import bucket_copy  # it uses this module's follow-ups

        with leased(settings, waiting):
            return bucket_copy.send_to_store(settings, cp.id, sha, size, worker_id, src, peers, named)

    # One upload can outlast the lease on a slow link: the stores waiting for it keep theirs
    # by time meanwhile, or the scheduler would send this step again beside the running one.
    with leased(settings, waiting):
        return _send_copy(settings, cp.id, sha, size, worker_id, url, src, peers, hops, named)


@dataclass(frozen=True)
class Hop:
    """A copy sent through the worker before it in a chain."""

    copy_id: int
    worker_id: str
    url: str


def _send_copy(settings: Settings, copy_id: int, sha: str, size: int, worker_id: str, url: str,
               src: Source | None, peers: list[tuple[str, str]], hops: Sequence[Hop] = (),
               named: dict[str, Any] | None = None) -> list[Send]:
    """Upload the content to the worker (from the local file, else from a peer's copy), passed
    on along ``hops`` when it comes from the local file; record each worker's re-hash; the
    follow-up messages (naming the same source). A copy of ``hops`` not stored through the
    chain is sent on its own."""
    client = WorkerClient(url, settings.key(), worker_id, timeout=settings.stall_seconds)
    alone = [again(h.copy_id, named) for h in hops]
    reached: dict[str, dict[str, Any]] = {}
    try:
        held = client.head(sha)
        if held != size:
            if src is not None:
                failpoints.hit("replicate.send")  # the worker lacks it: the bytes go now
                answer = client.put_range(sha, shard_prefix(src.path, src.kind, src.tensors), src.path, src.offset,
                                          src.length, chain=[(h.worker_id, h.url) for h in hops],
                                          wire=settings.wire_compression, codecs=settings.wire_codecs)
                reached = {str(r.get("node")): r for r in answer.get("chain") or [] if isinstance(r, dict)}
            elif not _copy_from_peer(settings, client, sha, size, peers):
                return _abandon(settings, copy_id, "no local file and no good copy holds its bytes") + alone
        # Re-hashed from the worker's disk now, while other copies are still uploading,
        # rather than all together in the verify step once the last upload is done.
        # No byte moves while the worker hashes: the wait is for work, not a stalled transfer.
        rehashed = WorkerClient(url, settings.key(), worker_id).verify([sha])[0]["sha256"]
    except WorkerError as exc:
        if exc.status == 422 and src is not None:
            # What the worker received does not hash to the content. Either the source changed
            # under us, or the bytes were damaged on the way: read it again here.
            if source_matches(src.path, src.kind, src.tensors, src.offset, src.length, sha):
                raise WorkerError(url, f"content {sha[:12]} arrived damaged (the source is intact); "
                                       "sending it again") from exc
            return _source_gone(settings, copy_id, src, S.SUPERSEDED, str(exc)) + alone
        if exc.status is None or exc.status == 507:  # unreachable or full: place this copy elsewhere
            return _move_off(settings, copy_id, worker_id, str(exc), full=exc.status == 507, named=named) + alone
        raise
    except OSError as exc:
        # The source is gone (vanished, before it was protected) or unreadable (superseded).
        assert src is not None
        end = S.VANISHED if isinstance(exc, FileNotFoundError) else S.SUPERSEDED
        return _source_gone(settings, copy_id, src, end, f"{src.path}: {exc}") + alone

    results = [(copy_id, rehashed)]
    resend: list[Send] = []
    failed: list[tuple[Hop, dict[str, Any]]] = []
    for h in hops:
        if reached.get(h.worker_id, {}).get("ok") is not True:
            failed.append((h, reached.get(h.worker_id, {})))
            continue
        try:
            results.append((h.copy_id, WorkerClient(h.url, settings.key(), h.worker_id).verify([sha])[0]["sha256"]))
        except WorkerError as exc:
            log.warning("copy %d of %s on %s: stored through the chain, re-hash failed (%s); sending it again",
                        h.copy_id, sha[:12], h.worker_id, exc)
            resend.append(again(h.copy_id, named))
    with session_scope(settings.db_url) as s:
        t = now()
        for cid, answer in results:
            # Stored; verified by the re-hash if it matched. One that does not re-hash to its name
            # stays "stored": the verify step finds it corrupt and replaces it.
            if move(s, ContentCopy.id == cid, CopyState.STORED, at=t, from_=(CopyState.PENDING,)) and answer == sha:
                move(s, ContentCopy.id == cid, CopyState.VERIFIED, at=t, from_=(CopyState.STORED,))
        for job in waiting_jobs(s, sha):
            grown = Job.bytes_done + size * len(results)
            s.execute(update(Job).where(Job.id == job.id)
                      .values(bytes_done=case((grown > Job.bytes_total, Job.bytes_total), else_=grown)))
        sends = fan_in(s, settings, sha) + to_stores_once_held(s, sha, len(results))
    return sends + resend + [m for h, entry in failed for m in _hop_failed(settings, h, entry, named)]


def to_stores_once_held(s: Session, sha: str, just_verified: int) -> list[Send]:
    """The messages that send content ``sha``'s pending copies on object stores, when the copies
    just verified are its first on workers (pipeline.store.sharding.replicate_sends held them back
    for a worker to put)."""
    on_workers = s.scalar(
        select(func.count(ContentCopy.id)).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .where(ContentCopy.sha256 == sha, ContentCopy.state == CopyState.VERIFIED,
               StorageWorker.tier == Tier.WORKERS)) or 0
    if not just_verified or on_workers > just_verified:
        return []
    return [Send("replicate", (cid,)) for cid in s.scalars(
        select(ContentCopy.id).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .where(ContentCopy.sha256 == sha, ContentCopy.state == CopyState.PENDING,
               StorageWorker.tier == Tier.OBJECT_STORE))]


def on_its_way(content: Content) -> bool:
    """Whether ``content`` is being sent to workers and none holds it yet: a copy pending on one
    (sent by the shard step, or while hashing: pipeline.store.early), none verified. Its copies
    on object stores wait: the first verified worker copies send them (:func:`to_stores_once_held`)
    and a worker puts them; sent before, with no worker to put them, this host would send the
    bytes a second time (measured in the cluster in a box: the trainer's link sent 2.0x the
    checkpoint, the bucket's link received 1.0x)."""
    on_workers = [c.state for c in content.copies if c.worker.tier == Tier.WORKERS]
    return CopyState.PENDING in on_workers and CopyState.VERIFIED not in on_workers


def _hop_failed(settings: Settings, hop: Hop, entry: dict[str, Any], named: dict[str, Any] | None) -> list[Send]:
    """A copy not stored through the chain, ``entry`` being what the worker before it said:
    a hop that gave no answer (unreachable, stalled) or answered 507 is marked and loses the
    copy to another worker, on that evidence; any other is sent the copy again on its own
    (from the source, or a copy upstream)."""
    status = entry.get("status", "not sent")
    if status is None or status == 507:
        why = f"through the chain: {str(entry.get('error') or 'no answer')[:300]}"
        try:
            return _move_off(settings, hop.copy_id, hop.worker_id, why, full=status == 507, named=named)
        except WorkerError:  # nowhere else to go: sent again to it, the retry may find it back
            pass
    return [again(hop.copy_id, named)]


def again(copy_id: int, named: dict[str, Any] | None = None) -> Send:
    """The message that sends one copy (again), from the source ``named`` if one was."""
    return Send("replicate", (copy_id, [], named) if named else (copy_id,))


def _copy_from_peer(settings: Settings, target: WorkerClient, sha: str, size: int,
                    peers: list[tuple[str, str]]) -> bool:
    """Copy the content from a worker that holds a verified copy (the target checks its hash)."""
    key = settings.key()
    for url, worker_id in peers:
        try:
            target.copy_from(WorkerClient(url, key, worker_id, timeout=settings.stall_seconds), sha, size)
            return True
        except WorkerError as exc:
            if exc.worker == target.url and exc.status is None:
                raise
            log.warning("copy of %s from %s failed: %s", sha[:12], worker_id, exc)
    return False


def short_contents(session: Session, checkpoint_id: int, rf: int, tier: str = Tier.WORKERS) -> int:
    """How many of a checkpoint's contents have fewer than ``rf`` copies stored on counting rows
    of ``tier``."""
    shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)
    stored = (
        select(ContentCopy.sha256, func.count(ContentCopy.id).label("n"))
        .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
        .where(ContentCopy.sha256.in_(shas), ContentCopy.state.in_(sorted(states.SENT)),
               StorageWorker.state.in_(sorted(COUNTING_WORKERS)), StorageWorker.tier == tier)
        .group_by(ContentCopy.sha256)
    ).subquery()
    return int(session.scalar(
        select(func.count(Content.sha256)).outerjoin(stored, stored.c.sha256 == Content.sha256)
        .where(Content.sha256.in_(shas), func.coalesce(stored.c.n, 0) < rf)
    ) or 0)


def fan_in_job(s: Session, settings: Settings, job_id: int) -> list[Send]:
    """Move one ``sharded`` store job on when every content of its checkpoint has RF copies
    stored on workers (and, when its run requires them, its copies on object stores)."""
    job = one(s, Job, job_id)
    if job.state != S.SHARDED or job.checkpoint_id is None:
        return []
    need = settings.need_for(one(s, Checkpoint, job.checkpoint_id).run)
    if short_contents(s, job.checkpoint_id, need.rf):
        return []
    if need.targets and (short := short_contents(s, job.checkpoint_id, need.targets, Tier.OBJECT_STORE)):
        _waits_for_stores(s, job, short, need.targets)
        return []
    if transition(s, job_id, JobKind.STORE, S.SHARDED, S.REPLICATED, lease_seconds=settings.lease_seconds,
                  detail="every content has RF stored copies"
                         + (f" and {need.targets} on object stores" if need.targets else ""),
                  bytes_done=job.bytes_total, blocked_reason=None):
        return [Send("verify", (job_id,))]
    return []


def _waits_for_stores(s: Session, job: Job, short: int, wanted: int) -> None:
    """Say why a store job whose workers hold its copies still waits: its run requires copies on
    object stores, and what the stores said (a store never admitted, down, throttling)."""
    stores = s.scalars(select(StorageWorker).where(StorageWorker.tier == Tier.OBJECT_STORE)
                       .order_by(StorageWorker.id)).all()
    said = "; ".join(f"{w.id} is {w.state}" + (f": {w.last_error[:200]}" if w.last_error else "") for w in stores
                     if w.state not in COUNTING_WORKERS or w.last_error) or "their copies are on their way"
    reason = f"waiting for its object-store copies ({short} contents short of {wanted}): {said}"
    if job.blocked_reason != reason and not (job.blocked_reason or "").startswith("waiting for its object-store copy:"):
        job.blocked_reason = reason
        note(s, job.id, reason)


def fan_in(s: Session, settings: Settings, sha: str) -> list[Send]:
    """Fan-in for every store waiting on content ``sha``."""
    sends: list[Send] = []
    for job in waiting_jobs(s, sha):
        sends += fan_in_job(s, settings, job.id)
    return sends


def _abandon(settings: Settings, copy_id: int, why: str) -> list[Send]:
    with session_scope(settings.db_url) as s:
        cp = one(s, ContentCopy, copy_id)
        move(s, ContentCopy.id == copy_id, CopyState.ABANDONED, error=why)
        log.error("copy %d of %s abandoned: %s", copy_id, cp.sha256[:12], why)
        for job in waiting_jobs(s, cp.sha256):
            note(s, job.id, f"content {cp.sha256[:12]}: {why}")
        return []


def _source_gone(settings: Settings, copy_id: int, src: Source, end: S, why: str) -> list[Send]:
    """The local file the copy was sent from changed or vanished: that store ends; the copy is
    sent again from another source if one exists (the next attempt looks)."""
    with session_scope(settings.db_url) as s:
        if src.job_id is not None:
            job = one(s, Job, src.job_id)
            if states.allowed(JobKind.STORE, job.state, end):
                transition(s, src.job_id, JobKind.STORE, job.state, end, detail=why, last_error=why)
        cp = one(s, ContentCopy, copy_id)
        others = waiting_jobs(s, cp.sha256)
    return [Send("replicate", (copy_id,))] if others else []


def _move_off(settings: Settings, copy_id: int, worker_id: str, error: str, *, full: bool,
              named: dict[str, Any] | None = None) -> list[Send]:
    with session_scope(settings.db_url) as s:
        worker = one(s, StorageWorker, worker_id)
        workers.observe(s, worker, WorkerState.FULL if full else WorkerState.DOWN, error=error)
        cp = one(s, ContentCopy, copy_id)
        if cp.state != CopyState.PENDING:
            return []
        move(s, cp, CopyState.ABANDONED, error=error)
        try:
            with s.begin_nested():
                moved = place_one(s, cp.content)
        except PlacementError:
            if not full:  # unreachable, nowhere else to go: roll back; the retry may find the worker back
                raise WorkerError(worker.url, f"{error}; no other worker can take the copy") from None
            # Full, and every other worker too: the stores waiting on this content wait for room
            # (the scheduler places them again once their wait ends: pipeline.store.sharding).
            reason = capacity_reason(s, settings, [cp.content], content_rf(s, settings, cp.sha256))
            for job in waiting_jobs(s, cp.sha256):
                transition(s, job.id, JobKind.STORE, S.SHARDED, S.WAITING, detail=reason, blocked_reason=reason,
                           lease_seconds=settings.lease_seconds)
            log.warning("copy %d: %s full and no other worker has room; its stores wait", copy_id, worker_id)
            return []
        what = "full" if full else "unreachable"
        for job in waiting_jobs(s, cp.sha256):
            note(s, job.id, f"worker {worker_id} {what} ({error}); content {cp.sha256[:12]} moves to "
                            f"{moved.worker_id}")
        log.warning("copy %d: %s %s, moved to %s", copy_id, worker_id, what, moved.worker_id)
        return [again(moved.id, named)]
