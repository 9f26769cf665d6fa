"""The shard step: ``detected -> sharded``.

Detection already planned every file and hashed it and its shards in one read (the
shard rows exist). This step places each shard's replicas and commits the placement and
the transition together. A file that still has the size and mtime it was detected with
is not read again: each storage worker hashes what it receives and refuses bytes that do
not match the manifest, which supersedes the job if the source changed anyway. A file
whose size or mtime moved is re-hashed (a ``touch`` is not a change).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.capacity import capacity_reason
from pipeline.core.placement import chain_orders
from pipeline.core.planner import plan
from pipeline.db.copies import contents_of, place, shas_of
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, Content, ContentCopy, Job
from pipeline.db.transitions import transition
from pipeline.detection import roots
from pipeline.detection.catalog import file_path, own_files, owner_elsewhere
from pipeline.detection.completeness import read_header
from pipeline.errors import PlacementError
from pipeline.hashing import scan
from pipeline.integrity.repair import repair_damaged
from pipeline.leases import leased
from pipeline.objectstore.tier import is_target
from pipeline.settings import Settings
from pipeline.states import ContentState, CopyState, JobKind, Tier
from pipeline.steps import Send, begin_step
from pipeline.store.replication import fan_in_job, on_its_way

log = logging.getLogger("ckpt.shard")
S = states.StoreState


def shard_checkpoint(settings: Settings, job_id: int, sent: Sequence[int] = ()) -> list[Send]:
    """Place the checkpoint's contents and send their copies, except ``sent``: those detection
    already sent while it hashed (pipeline.store.early)."""
    with session_scope(settings.db_url) as s:
        if owner_elsewhere(s, s.scalar(select(Job.checkpoint_id).where(Job.id == job_id)), settings.host_id):
            return [Send("shard", (job_id, list(sent)))]  # its files are on another host: sent there
        job = begin_step(s, settings, job_id, S.DETECTED)
        if job is None:
            return []
        ckpt = one(s, Checkpoint, job.checkpoint_id)
        ckpt_id, run = ckpt.id, ckpt.run
        # Only this host's files: the parts other hosts hold were hashed there when announced,
        # and each storage worker refuses bytes that do not match what was announced.
        files = [(f.id, f.relpath or ckpt.path, file_path(ckpt, f), f.format, f.size, f.mtime_ns, f.sha256)
                 for f in own_files(ckpt)]

    # Re-hashing a touched file can outlast the lease: kept by time meanwhile (pipeline/leases.py).
    with leased(settings, [job_id]):
        for _file_id, name, path, fmt, size, mtime_ns, sha in files:
            try:
                st = os.stat(path)
                if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
                    continue
                # Touched since detection: read it again (a `touch` is not a change).
                plans = plan(read_header(path) if fmt == "safetensors" else None, size, settings.shard_size)
                file_sha, _shard_shas = scan(path, plans, expected_size=size)
                if file_sha != sha:
                    return _end(settings, job_id, S.SUPERSEDED, f"{name}: content changed since detection")
            except FileNotFoundError:
                return _end(settings, job_id, S.VANISHED, f"{name} was deleted before it was protected")
            except (OSError, ValueError) as exc:
                return _end(settings, job_id, S.SUPERSEDED, f"{name} can no longer be read as detected ({exc})")

    mode = settings.options_for(roots.root_of(Path(run), settings.roots)).replication
    with session_scope(settings.db_url) as s:
        contents = revive(s, contents_of(s, ckpt_id))
        try:
            with s.begin_nested():  # all contents placed, or none
                for c in contents:
                    place(s, c, settings.rf_for(run))
            place_on_stores(s, settings, contents, run)
        except PlacementError:
            s.expire_all()
            blocked = contents_of(s, ckpt_id)
            repairs = repair_damaged(s, settings, shas_of(ckpt_id),
                                     f"checkpoint {ckpt_id} cannot be placed while this copy is damaged")
            return _wait(s, settings, job_id, capacity_reason(s, settings, blocked, settings.rf_for(run))) + repairs
        # Copies sent while hashing may be stored by now: read them as their last commit left
        # them, locked, so that an upload committing after this either sees this job sharded
        # (and fans it in) or was seen stored here (PostgreSQL; SQLite writes one at a time).
        placed = [cp.id for c in contents for cp in c.copies if cp.state == CopyState.PENDING]
        if placed:
            s.scalars(select(ContentCopy).where(ContentCopy.id.in_(placed)).order_by(ContentCopy.id).with_for_update()
                      .execution_options(populate_existing=True)).all()
        pending = [cp for c in contents for cp in c.copies if cp.state == CopyState.PENDING]
        moved = transition(s, job_id, JobKind.STORE, S.DETECTED, S.SHARDED, lease_seconds=settings.lease_seconds,
                           detail=f"{len(contents)} contents, {len(pending)} copies to send, RF {settings.rf_for(run)}"
                                  + (f", {mode}" if pending else "")
                                  + (f"; {len(sent)} sent while hashing" if sent else ""),
                           bytes_done=0, bytes_total=sum(cp.content.size for cp in pending), blocked_reason=None)
        if not moved:
            raise RuntimeError("job left 'detected' while sharding; rolling back this placement")
        skip = set(sent)
        sends = replicate_sends([cp for cp in pending if cp.id not in skip], mode)
        if pending and any(cp.state == CopyState.VERIFIED for c in contents for cp in c.copies):
            # Copies it shares with earlier checkpoints are re-hashed beside the uploads, not
            # after them; first, so that a busy queue does not hold it behind them.
            sends.insert(0, Send("recheck", (job_id,)))
        if not pending:  # every content already has RF copies (a step that changed nothing)
            sends = fan_in_job(s, settings, job_id)
    log.info("job %d: %d contents, %d copies to send", job_id, len(contents), len(pending))
    return sends


def place_on_stores(s: Session, settings: Settings, contents: list[Content], run: str) -> None:
    """The copies ``run``'s policy wants on object stores (``target_copies``), where a store can
    take them now. One that cannot yet is placed by the scheduler's object-store sweep later
    (a store job that requires it waits in ``sharded`` meanwhile): never a reason to hold back
    the workers' copies."""
    wanted = settings.target_policy(run)[0]
    for c in contents if wanted else ():
        try:
            with s.begin_nested():
                place(s, c, wanted, tier=Tier.OBJECT_STORE)
        except PlacementError as exc:
            log.info("content %s: no object store takes its copy now (%s); placed later", c.sha256[:12], exc)
            return


def replicate_sends(pending: list[ContentCopy], mode: str) -> list[Send]:
    """The messages that send ``pending`` copies: one per copy (``fanout``), or one per content
    whose first copy's worker passes the bytes on to the others' (``chain``), the first hops
    spread so that every worker's link works (:func:`pipeline.core.placement.chain_orders`).
    The mode is the checkpoint's root's (``replication`` in its options), else CKPT_REPLICATION.
    A copy on an object store is sent by a message of its own (never a hop of a chain), once a
    worker holds the content when it is still on its way to them."""
    # A content on its way to workers goes to an object store once a worker holds it (the worker
    # puts it there: pipeline.store.replication sends it then); one already on workers goes now.
    alone = [Send("replicate", (cp.id,)) for cp in pending if is_target(cp.worker_id) and not on_its_way(cp.content)]
    pending = [cp for cp in pending if not is_target(cp.worker_id)]
    if mode != "chain":
        return [Send("replicate", (cp.id,)) for cp in pending] + alone
    per_content: dict[str, dict[str, ContentCopy]] = {}
    for cp in pending:
        per_content.setdefault(cp.sha256, {})[cp.worker_id] = cp
    groups = list(per_content.values())
    orders = chain_orders([(next(iter(g.values())).content.size, list(g)) for g in groups])
    sends = []
    for g, order in zip(groups, orders, strict=True):
        ids = [g[w].id for w in order]
        sends.append(Send("replicate", (ids[0], ids[1:]) if len(ids) > 1 else (ids[0],)))
    return sends + alone


def revive(s: Session, contents: list[Content]) -> list[Content]:
    """Content being collected (or collected) that this store references is live again.

    Under the content's row lock, which the collection's sweep also takes before it marks
    copies ``deleting`` (pipeline.integrity.gc): copies it marked before are never counted
    again and placement puts new ones elsewhere; copies it did not mark yet it never will
    (it re-checks under the lock), so they count again. docs/design.md, section 5.
    """
    stale = [c.sha256 for c in contents if c.state != ContentState.LIVE]
    if not stale:
        return contents
    for c in s.scalars(select(Content).where(Content.sha256.in_(stale)).order_by(Content.sha256).with_for_update()
                       .execution_options(populate_existing=True)):
        if c.state != ContentState.LIVE:
            log.info("content %s was %s; referenced again, it is live and uploaded anew where needed",
                     c.sha256[:12], c.state)
            c.state, c.condemned_at = ContentState.LIVE, None
    s.flush()
    return contents


def _wait(s: Session, settings: Settings, job_id: int, reason: str) -> list[Send]:
    """The checkpoint cannot be placed now: it waits, saying why; the scheduler tries again
    once its lease ends (pipeline.service.scheduler.retry_waiting)."""
    transition(s, job_id, JobKind.STORE, S.DETECTED, S.WAITING, detail=reason, blocked_reason=reason,
               lease_seconds=settings.lease_seconds)
    log.warning("job %d waits: %s", job_id, reason)
    return []


def _end(settings: Settings, job_id: int, state: S, why: str) -> list[Send]:
    """The source is not what was detected any more: ``superseded`` (changed) or ``vanished`` (gone)."""
    with session_scope(settings.db_url) as s:
        transition(s, job_id, JobKind.STORE, S.DETECTED, state, detail=why, last_error=why)
    log.warning("job %d %s: %s", job_id, state, why)
    return []
