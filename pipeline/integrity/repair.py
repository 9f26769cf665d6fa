"""Repair: bring one content back to RF copies that match its SHA-256, and its object-store copies back.

One repair job per content (a partial unique index allows one active at a time, so two repairs
never set aside each other's new copy). A source is a copy whose fresh re-hash matches, or a
local file that holds the content (the receiving worker checks its hash), or else a copy on an
object store (downloaded once into a temporary file of the home, its SHA-256 checked, then
uploaded to each worker that needs it): never "primary wins". A corrupt copy is quarantined on
its worker (moved aside, not served, not counted) and purged only after the new copy there
re-hashed correctly. A damaged copy on an object store is put again (a corrupt object deleted
first) from the local file, else from a worker's verified copy, and confirmed by the store's
checksum; a store that cannot take it now (throttled, unreachable, credentials) leaves the job
waiting, saying why, retried once its lease ends. A host that finds no good source while
another host's disk holds a local file of the content hands the job to that host
(``params.host``, which routes it there). A content with no good source on any tier or host is
``lost``: the job says so; a later repair (a copy came back) can still succeed.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from sqlalchemy import Select, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.cluster.client import WorkerClient
from pipeline.db import hosts
from pipeline.db.content_rf import content_rf
from pipeline.db.copies import good_copy, good_count, move, on, place_one
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, Job, Shard, StorageWorker
from pipeline.db.transitions import create_job, note, now, renew_lease, transition
from pipeline.errors import CkptError, ObjectMismatch, ObjectMissing, ObjectStoreError, PlacementError, WorkerError
from pipeline.leases import leased
from pipeline.objectstore.tier import store_for
from pipeline.settings import Settings
from pipeline.states import ContentState, CopyState, JobKind, StoreState, Tier
from pipeline.steps import Send, start_job
from pipeline.store.bucket_copy import put_confirmed, record_confirmed, spool_file
from pipeline.store.replication import fan_in_job, waiting_jobs
from pipeline.store.source import Source, holding_hosts, local_source, shard_prefix, source_matches

log = logging.getLogger("ckpt.repair")
P = states.RepairState


@dataclass
class ContentWork:
    sha: str
    size: int
    source: Source | None  # a local file that holds it, if any
    sources: list[tuple[str, str]] = field(default_factory=list)  # (worker id, url): readable copies
    fix_in_place: list[tuple[str, str, str]] = field(default_factory=list)  # (worker id, url, state)
    need: int = 0  # new copies to place on other workers
    #: Sources dropped because they did not answer (not proof that their copy is gone): with
    #: one of them, "no source left" is a retry later, never LOST.
    unreachable: list[str] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)  # object stores holding a readable copy: the last sources
    fix_on_stores: list[str] = field(default_factory=list)  # object stores holding a damaged copy
    #: The content downloaded from an object store (SHA-256 checked) for the workers that need it.
    spool: Path | None = None


def request_repair(session: Session, settings: Settings, sha: str, reason: str,
                   found_by: int | None = None) -> Job | None:
    """A repair job for content ``sha``, unless one is already queued or running. ``found_by``:
    the job that found the damage (a scrub, a reconcile), named on the incidents page."""
    active = session.scalar(select(Job.id).where(Job.kind == JobKind.REPAIR, Job.sha256 == sha,
                                                 Job.state.in_(sorted(states.ACTIVE[JobKind.REPAIR]))).limit(1))
    if active is not None:
        return None
    try:
        with session.begin_nested():
            return create_job(session, JobKind.REPAIR, checkpoint_id=None, sha256=sha,
                              params={"reason": reason, "sha256": sha} | ({"found_by": found_by} if found_by else {}),
                              lease_seconds=settings.lease_seconds,
                              detail=f"content {sha[:12]}: {reason}")
    except IntegrityError:  # another process asked for it at the same moment
        return None


def repair_damaged(session: Session, settings: Settings, shas: Select[str], reason: str,
                   tier: str = Tier.WORKERS) -> list[Send]:
    """Repair jobs for the contents ``shas`` selects that have a damaged (corrupt or missing) copy on a
    counting row of ``tier`` (a worker; or an object store); the messages that run them.

    Placement puts at most one copy of a content on a worker and never reuses a damaged row
    (its bad file is still there: only a repair quarantines it first), so a store whose content
    is damaged on too many workers cannot be placed until those copies are rebuilt in place,
    from its local file or a good copy. Its shard step, its re-drive and the scheduler's sweep
    ask for that here (docs/design.md, section 5), instead of waiting for room that is there.
    """
    sends = []
    for sha in session.scalars(
            select(ContentCopy.sha256).distinct()
            .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .join(Content, Content.sha256 == ContentCopy.sha256)
            .where(ContentCopy.sha256.in_(shas), ContentCopy.state.in_(sorted(states.DAMAGED)),
                   StorageWorker.state.in_(sorted(states.COUNTING_WORKERS)), StorageWorker.tier == tier,
                   Content.state == ContentState.LIVE)):
        job = request_repair(session, settings, sha, reason)
        if job is not None:
            sends.append(Send("repair", (job.id,)))
    return sends


def plan(s: Session, settings: Settings, sha: str) -> ContentWork | None:
    """What content ``sha`` needs, as plain data; None when it is fine (or no longer live)."""
    content = s.get(Content, sha)
    if content is None or content.state != ContentState.LIVE:
        return None
    w = ContentWork(sha, content.size, local_source(s, sha, settings.host_id))
    for c in s.scalars(select(ContentCopy).where(ContentCopy.sha256 == sha).order_by(ContentCopy.id)):
        ws, on_store = c.worker.state, c.worker.tier == Tier.OBJECT_STORE
        if c.state in states.READABLE_COPIES and ws in states.READABLE_WORKERS:
            if on_store:
                w.stores.append(c.worker_id)  # its SHA-256 is checked as it is downloaded
            else:
                w.sources.append((c.worker_id, c.worker.url))  # re-hashed before it is used
        elif c.state in states.DAMAGED and ws in states.COUNTING_WORKERS:
            if on_store:
                w.fix_on_stores.append(c.worker_id)
            else:
                w.fix_in_place.append((c.worker_id, c.worker.url, c.state))
    w.need = max(0, content_rf(s, settings, sha) - good_count(s, sha) - len(w.fix_in_place))
    return w if (w.fix_in_place or w.need or w.fix_on_stores) else None


#: Re-plans after the first: copies found bad while this repair ran (concurrent scrubs of
#: other workers) are fixed by it, not left for the next under-replication sweep.
MAX_PASSES = 4


def repair(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        runs_on = (s.scalar(select(Job.params).where(Job.id == job_id)) or {}).get("host")
        if runs_on not in (None, settings.host_id):
            return [Send("repair", (job_id,))]  # handed to the host that holds a local file: sent there
        job = start_job(s, settings, job_id, JobKind.REPAIR, P.QUEUED, P.REPAIRING)
        if job is None:
            return []
        if job.blocked_reason is not None:  # resumed after a wait: it works again
            renew_lease(s, job_id, settings.lease_seconds, blocked_reason=None)
        sha = str(job.sha256 or job.params["sha256"])

    key = settings.key()
    fixed, lost, unreachable, waits = 0, False, list[str](), list[str]()
    # One copy can outlast the lease (a slow link): kept by time meanwhile.
    with leased(settings, [job_id]), closing(_passes(settings, sha)) as passes:
        for w in passes:
            try:
                for worker_id, url, state in w.fix_in_place:
                    _rebuild_on(settings, key, w, worker_id, url, quarantine_first=state == CopyState.CORRUPT)
                    fixed += 1
                for _ in range(w.need):
                    with session_scope(settings.db_url) as s:
                        try:
                            target = place_one(s, one(s, Content, sha)).worker_id
                        except PlacementError:
                            # Every live worker that is not full holds a row of it already (RF
                            # as many as the workers, one down or its copy unverified): not a
                            # failed attempt; tried again when its lease ends, a worker may have
                            # come meanwhile (it used to raise, be retried and dead-letter).
                            waits.append(_no_placement(s, settings, sha))
                            break
                        url = one(s, StorageWorker, target).url
                    try:
                        _rebuild_on(settings, key, w, target, url, quarantine_first=False)
                    except BaseException:
                        _give_back(settings, target, sha)
                        raise
                    fixed += 1
            except _NoSource as exc:
                lost, unreachable = True, list(exc.args[0]) if exc.args else []
                for bad_worker, url, state in w.fix_in_place:  # every bad copy is set aside, none deleted
                    if state == CopyState.CORRUPT:
                        _quarantine(key, bad_worker, url, w.sha)
                break
            for store_id in w.fix_on_stores:
                why = _rebuild_on_store(settings, w, store_id)
                if why is None:
                    fixed += 1
                else:
                    waits.append(f"waiting for the object store: {why}")
            with session_scope(settings.db_url) as s:
                renew_lease(s, job_id, settings.lease_seconds)
            if waits:
                break

    with session_scope(settings.db_url) as s:
        if lost and (handed := _hand_over(s, settings, job_id, sha)):
            return handed
        if lost and unreachable:
            # A copy whose worker did not answer (killed, restarting, partitioned) may be fine:
            # not LOST, retried (found by the chaos soak: a repair while its only source restarted).
            raise WorkerError(unreachable[0], f"no reachable good copy of {sha[:12]} now ({len(unreachable)} "
                                              "did not answer): the repair is retried")
        if lost:
            detail = f"LOST: no copy and no local file matches content {sha[:12]} ({_users(s, sha)})"
            transition(s, job_id, JobKind.REPAIR, P.REPAIRING, P.LOST, detail=detail, last_error=detail)
            log.error(detail)
            return []
        if waits:
            # Not the copy's fault: nothing more is marked, and a wait is no failed attempt (a
            # store throttled or a worker down for hours must not use them up). Resumed when the
            # lease ends.
            why = waits[0][:1000]
            if one(s, Job, job_id).blocked_reason != why:
                note(s, job_id, why)
            renew_lease(s, job_id, settings.lease_seconds, blocked_reason=why, attempts=0)
            log.warning("repair of %s waits: %s", sha[:12], waits[0])
            return []
        transition(s, job_id, JobKind.REPAIR, P.REPAIRING, P.DONE, detail=f"{fixed} copies rebuilt and verified",
                   blocked_reason=None)
        sends = _wake_stores(s, settings, sha)
        runs = list(s.scalars(
            select(Checkpoint.run).join(CheckpointFile).join(Shard)
            .where(Shard.sha256 == sha, Checkpoint.local_present.is_(True)).distinct().limit(20)))
    log.info("content %s repaired: %d copies rebuilt", sha[:12], fixed)
    return sends + [Send("rotate_run", (run,)) for run in runs]


def _no_placement(s: Session, settings: Settings, sha: str) -> str:
    """Why a repair of ``sha`` has no worker to place a copy on, and what to do."""
    return (f"waiting for a storage worker to place a copy on: every live worker with room holds a row of "
            f"{sha[:12]} already, good or not (RF {content_rf(s, settings, sha)}); start another (`ckpt worker`) "
            "or bring a down one back")


def _give_back(settings: Settings, worker_id: str, sha: str) -> None:
    """A copy placed for this repair that it could not fill (its worker refused or failed, or no
    source was left) is given up, so that the next try may choose that worker again: a pending
    row nobody fills would keep it out of this content's placements for good (one per worker)."""
    with session_scope(settings.db_url) as s:
        move(s, on(worker_id, sha), CopyState.ABANDONED, from_={CopyState.PENDING},
             error="the repair that placed it could not fill it")


def _wake_stores(s: Session, settings: Settings, sha: str) -> list[Send]:
    """Stores held by this content's damaged copies go on now, not at their next re-drive: a
    sharded one fans in (its copies may all be there now), a waiting one is placed again."""
    sends = []
    for job in waiting_jobs(s, sha):
        sends += fan_in_job(s, settings, job.id)
    for job in waiting_jobs(s, sha, StoreState.WAITING):
        if transition(s, job.id, JobKind.STORE, StoreState.WAITING, StoreState.DETECTED,
                      lease_seconds=settings.lease_seconds,
                      detail=f"trying placement again: content {sha[:12]} was repaired"):
            sends.append(Send("shard", (job.id,)))
    return sends


def _hand_over(s: Session, settings: Settings, job_id: int, sha: str) -> list[Send]:
    """No copy and no local file here holds the content: send the job to another host whose
    disk holds a local file of it (one with a running consumer first), never to one that
    already tried. Nothing (then the content is ``lost``) when no other host holds one."""
    job = one(s, Job, job_id)
    tried = {*job.params.get("tried_hosts", ()), settings.host_id}
    holders = [h for h in holding_hosts(s, sha) if h is not None and h not in tried]
    if not holders:
        return []
    live = {h.id for h in hosts.with_consumer(s, settings)}
    target = next((h for h in holders if h in live), holders[0])
    renew_lease(s, job_id, settings.lease_seconds,
                params={**job.params, "host": target, "tried_hosts": sorted(tried)})
    note(s, job_id, f"no good copy and no local file of content {sha[:12]} on {settings.host_id}: handed to host "
                    f"{target}, whose disk holds one")
    log.warning("repair of %s handed to host %s, which holds a local file of it", sha[:12], target)
    return [Send("repair", (job_id,))]


def _users(s: Session, sha: str) -> str:
    """Which checkpoints reference a content, for messages."""
    rows = s.execute(select(Checkpoint.id, Checkpoint.name).join(CheckpointFile).join(Shard)
                     .where(Shard.sha256 == sha).distinct().limit(4)).all()
    shown = ", ".join(f"checkpoint {i} {n}" for i, n in rows[:3])
    return f"used by {shown}{' and more' if len(rows) > 3 else ''}" if rows else "used by no checkpoint"


def _passes(settings: Settings, sha: str) -> Generator[ContentWork, None, None]:
    """The work on the content, planned again after each pass until nothing is left."""
    for _ in range(MAX_PASSES):
        with session_scope(settings.db_url) as s:
            work = plan(s, settings, sha)
        if work is None:
            return
        try:
            yield work
        finally:
            if work.spool is not None:
                work.spool.unlink(missing_ok=True)


class _NoSource(Exception):
    """Raised when no candidate source is left while rebuilding: its argument lists the
    sources dropped because they did not answer (an empty list: every one was proven bad)."""


def _no_source(w: ContentWork) -> NoReturn:
    raise _NoSource(w.unreachable)


def _good_source(settings: Settings, key: bytes, w: ContentWork) -> WorkerClient | None:
    """The first readable copy whose re-hash, now, matches the content's SHA-256."""
    while w.sources:
        worker_id, url = w.sources[0]
        client = WorkerClient(url, key, worker_id)
        try:
            (answer,) = client.verify([w.sha])
        except (WorkerError, ValueError):
            w.unreachable.append(url)
            w.sources.pop(0)
            continue
        if answer["sha256"] == w.sha:
            return client
        w.sources.pop(0)
        with session_scope(settings.db_url) as s:  # it was counted as good: not any more
            state = CopyState.MISSING if answer["sha256"] is None else CopyState.CORRUPT
            move(s, on(worker_id, w.sha), state, from_=states.HELD, error=f"re-hash at repair: {answer['sha256']}")
        if answer["sha256"] is not None:
            _quarantine(key, worker_id, url, w.sha)
        w.fix_in_place.append((worker_id, url, CopyState.MISSING))  # set aside; rebuilt there like a missing copy
    return None


def _quarantine(key: bytes, worker_id: str, url: str, sha: str) -> None:
    try:
        WorkerClient(url, key, worker_id).quarantine([sha])
    except WorkerError as exc:  # it stays marked corrupt: never served by us, never counted
        log.warning("could not quarantine %s on %s: %s", sha[:12], url, exc)


def _rebuild_on(settings: Settings, key: bytes, w: ContentWork, worker_id: str, url: str, *,
                quarantine_first: bool) -> None:
    """Put a verified copy of the content on ``worker_id``; raise :class:`_NoSource` if none exists."""
    target = WorkerClient(url, key, worker_id)
    if quarantine_first:
        target.quarantine([w.sha])  # moved aside: not served, not counted, not yet deleted
    _transfer(settings, key, w, _good_source(settings, key, w), target)
    (answer,) = target.verify([w.sha])
    t = now()
    if answer["sha256"] != w.sha:
        with session_scope(settings.db_url) as s:
            move(s, on(worker_id, w.sha), CopyState.CORRUPT, at=t, from_=states.DAMAGED | {CopyState.PENDING},
                 error=f"re-hash after repair gave {answer['sha256']}")
        raise WorkerError(url, f"copy of {w.sha[:12]} did not verify after repair")
    with session_scope(settings.db_url) as s:  # stored anew there, and its re-hash matched
        move(s, on(worker_id, w.sha), CopyState.STORED, at=t)
        move(s, on(worker_id, w.sha), CopyState.VERIFIED, at=t)
    target.purge_quarantined([w.sha])  # only now that the new copy verified


def _transfer(settings: Settings, key: bytes, w: ContentWork, source: WorkerClient | None,
              target: WorkerClient) -> None:
    """Copy the content to ``target`` from a good copy, else from a local file.

    The target hashes what it receives: a source that turns out bad is dropped for the next.
    Raises :class:`_NoSource` when nothing good is left; an unreachable target raises.
    """
    while source is not None:
        try:
            target.copy_from(source, w.sha, w.size)
            return
        except WorkerError as exc:
            if exc.worker == target.url and exc.status != 422:
                # The target is unreachable or refused the copy (its disk full): its failure, not
                # the source's; retry the job later. Only a 422 (what it received did not hash
                # to the content) puts the source in doubt.
                raise
            log.warning("repair of %s from %s failed (%s); trying the next copy", w.sha[:12], source.url, exc)
            if exc.worker == source.url and exc.status is None:
                w.unreachable.append(source.url)
            w.sources.pop(0)
            source = _good_source(settings, key, w)
    src = w.source
    if src is None:
        _from_store(settings, w, target)
        return
    try:
        target.put_range(w.sha, shard_prefix(src.path, src.kind, src.tensors), src.path, src.offset, src.length)
    except WorkerError as exc:
        if exc.status != 422:
            raise
        if source_matches(src.path, src.kind, src.tensors, src.offset, src.length, w.sha):
            raise  # damaged on the way, the local copy is fine: the retry sends it again
        w.source = None  # the local copy no longer holds the content
        _from_store(settings, w, target)
    except (OSError, CkptError):
        w.source = None
        _from_store(settings, w, target)


def _from_store(settings: Settings, w: ContentWork, target: WorkerClient) -> None:
    """Upload the content to ``target`` from a copy on an object store, the last source (no
    worker's copy, no local file); raise :class:`_NoSource` when no store holds it either."""
    path = _spooled(settings, w)
    if path is None:
        _no_source(w)
    target.put_range(w.sha, b"", str(path), 0, w.size)  # the worker checks its hash as it receives it


def _spooled(settings: Settings, w: ContentWork) -> Path | None:
    """The content downloaded from the first object store whose copy hashes to it (once per pass,
    for every worker that needs it). A copy found absent or other bytes is marked so and put
    again after the workers' copies (``fix_on_stores``); a store that cannot answer now is
    unreachable (the repair is retried, nothing is lost)."""
    while w.spool is None and w.stores:
        store_id = w.stores.pop(0)
        fd, name = spool_file(settings, f"repair-{w.sha[:12]}-")
        os.close(fd)
        try:
            store_for(settings, store_id).get(w.sha, Path(name), size=w.size)  # its SHA-256 checked
            w.spool = Path(name)
        except ObjectStoreError as exc:
            Path(name).unlink(missing_ok=True)
            if exc.wait:
                w.unreachable.append(str(exc))
                continue
            with session_scope(settings.db_url) as s:
                bad = CopyState.MISSING if isinstance(exc, ObjectMissing) else CopyState.CORRUPT
                move(s, on(store_id, w.sha), bad, from_=states.HELD, error=f"at repair: {exc.reason}")
            w.fix_on_stores.append(store_id)
    return w.spool


def _rebuild_on_store(settings: Settings, w: ContentWork, store_id: str) -> str | None:
    """Put the content again on the object store ``store_id``, whose copy is damaged, and record
    it confirmed; None when done, else why it must wait (the store cannot take it now, or no
    source holds its bytes now).

    A corrupt object is deleted first: an object the store's checksum still vouches for would
    otherwise be kept as it is (pipeline.store.bucket_copy confirms before it puts).
    """
    with session_scope(settings.db_url) as s:
        corrupt = s.scalar(select(ContentCopy.state).where(on(store_id, w.sha))) == CopyState.CORRUPT
        peers = [(url, worker_id) for worker_id, url in s.execute(
            select(ContentCopy.worker_id, StorageWorker.url)
            .join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .join(Content, Content.sha256 == ContentCopy.sha256)
            .where(ContentCopy.sha256 == w.sha, good_copy()).order_by(ContentCopy.id))]
    src = w.source
    try:
        store = store_for(settings, store_id)
        if corrupt:
            store.delete(w.sha)
        try:
            stored = put_confirmed(settings, store, w.sha, w.size, src, peers)
        except ObjectMismatch:
            if src is None or source_matches(src.path, src.kind, src.tensors, src.offset, src.length, w.sha):
                raise
            stored = put_confirmed(settings, store, w.sha, w.size, None, peers)  # the local file changed
        except OSError:
            stored = put_confirmed(settings, store, w.sha, w.size, None, peers)  # the local file went
    except ObjectStoreError as exc:
        log.warning("repair of %s on %s waits: %s", w.sha[:12], store_id, exc)
        return str(exc)
    if stored is None:
        return f"object store {store_id}: no local file and no worker's good copy of {w.sha[:12]} to put there now"
    with session_scope(settings.db_url) as s:
        record_confirmed(s, on(store_id, w.sha), stored, from_=states.DAMAGED)
    return None
