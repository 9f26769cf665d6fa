"""Rotation: remove old local checkpoints, only when they are safely elsewhere.

Invariant 1 (docs/design.md). A local checkpoint is deleted only inside a transaction
that sees every shard with at least RF good, fresh copies (pipeline.core.copies: the
decision is a pure function of plain rows) and no other active job on the checkpoint;
the workers are asked right before that transaction whether they still hold every copy.
When in doubt, the file stays and the job says why.

The local policy counts every local checkpoint of the run, forgotten ones too: a forgotten
checkpoint's local copy rotates like any other (its job stays ``forgotten``), and its
content stays on the workers until it has (pipeline.integrity.gc.kept_reference), so the
rule above holds for it as well.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, and_, select
from sqlalchemy.orm import Session

from pipeline import failpoints, states
from pipeline.core import copies
from pipeline.core.retention import LocalCheckpoint, to_rotate
from pipeline.core.savegroups import save_group
from pipeline.db.copies import fresh_after, shard_copies
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, CheckpointPart, Job, StorageWorker
from pipeline.db.transitions import latest_store_ids, note, transition
from pipeline.detection import parts, roots
from pipeline.detection.catalog import file_sig, latest_store_job, on_host, own_files, owner_elsewhere
from pipeline.detection.ondisk import Recorded
from pipeline.detection.ondisk import differs as changed_since_detection
from pipeline.errors import ObjectStoreError, OutsideRoots, WorkerError
from pipeline.objectstore.tier import client_for
from pipeline.settings import Settings
from pipeline.states import JobKind
from pipeline.steps import Send
from pipeline.store import trash
from pipeline.store.trash import move_to_trash, put_back

log = logging.getLogger("ckpt.rotate")
S = states.StoreState
#: Store states whose local copy the local policy may remove: verified; forgotten (the remote
#: policy dropped it; its content waits on the workers until the local copy is gone); rotated
#: (its files came back: restored to its own path).
ROTATABLE = frozenset({S.VERIFIED, S.FORGOTTEN, S.ROTATED})


def _coordinator_rotated(session: Session, job: Job) -> bool:
    """The coordinator's host removed its files of the job's checkpoint by rotation."""
    if job.state == S.ROTATED:
        return True
    ckpt = session.get(Checkpoint, job.checkpoint_id)
    return job.state == S.FORGOTTEN and ckpt is not None and not ckpt.local_present


def _local(run: str, host: str | None) -> ColumnElement[bool]:
    """The checkpoints of ``run`` whose local copy is on ``host``."""
    return and_(Checkpoint.run == run, Checkpoint.local_present.is_(True), on_host(host))


def rotation_candidates(session: Session, run: str, keep_last: int, host: str | None) -> list[int]:
    """Checkpoint ids of ``run`` on ``host`` that the local retention policy wants gone (each
    host keeps its own newest ``keep_last``)."""
    # The five columns the policy reads, not whole rows: every rotation asks this of every local
    # checkpoint of its run (hundreds while rotation catches up after a burst of saves).
    local = session.execute(select(Checkpoint.id, Checkpoint.step, Checkpoint.mtime, Checkpoint.is_dir,
                                   Checkpoint.name).where(_local(run, host)))
    return to_rotate([LocalCheckpoint(cid, step, mtime, "" if is_dir else save_group(name))
                      for cid, step, mtime, is_dir, name in local], keep_last)


def plan_run(settings: Settings, run: str) -> list[Send]:
    """Messages that rotate every checkpoint of ``run`` the policy wants gone and that is verified."""
    sends = []
    with session_scope(settings.db_url) as s:
        _empty_trash(s, run)
        # Every local checkpoint's newest store job in one query, not one per candidate: a run
        # whose rotation is behind has hundreds, and this runs after each verified save.
        local = select(Checkpoint.id).where(_local(run, settings.host_id))
        latest = {j.checkpoint_id: j for j in s.scalars(
            select(Job).where(Job.id.in_(latest_store_ids(Job.checkpoint_id.in_(local)))))}
        for cid in rotation_candidates(s, run, settings.keep_last, settings.host_id):
            job = latest.get(cid)
            if job is None:
                continue
            if job.state in ROTATABLE:
                sends.append(Send("rotate", (job.id,)))
            elif job.state not in states.TERMINAL[JobKind.STORE]:
                reason = f"rotation waits: the checkpoint is {job.state}, not yet verified"
                if job.blocked_reason is None or job.blocked_reason.startswith("rotation waits"):
                    job.blocked_reason = reason  # what its own step said it waits for says more
        # This host's parts of checkpoints the coordinator's host rotated (a message lost, or
        # blocked then): removed here too.
        for part in s.scalars(select(CheckpointPart).where(
                CheckpointPart.run == run, CheckpointPart.host == settings.host_id,
                CheckpointPart.local_present.is_(True), CheckpointPart.checkpoint_id.is_not(None))):
            job = latest_store_job(s, part.checkpoint_id) if part.checkpoint_id is not None else None
            if job is not None and _coordinator_rotated(s, job):
                sends.append(Send("rotate_part", (job.id, part.host)))
    return sends


def _empty_trash(session: Session, run: str) -> None:
    """Settle what rotations left in the run's trash (:func:`_settle`); one entry that cannot
    be deleted (a folder the trainer made read-only) is said and left, never stopping the run's
    other rotations."""
    for entry, was in trash.entries(run):
        try:
            _settle(session, entry, was)
        except OSError as exc:
            log.warning("could not settle %s, left by a rotation of %s (%s); it stays where it is",
                        entry, was, exc)


def _settle(session: Session, entry: Path, was: Path) -> None:
    """Delete a trash entry that a committed rotation left (a crash came before its delete),
    if it still is the rotated version's files; put anything else back (a save that landed on
    the path as a rotation was interrupted, bytes written through a file held open after it),
    for the watcher to store. An entry whose rotation did not commit is left for it (or the
    watcher) to put back."""
    rows = session.scalars(select(Checkpoint).where(Checkpoint.path == str(was))).all()
    held = session.scalars(select(CheckpointPart).where(CheckpointPart.path == str(was))).all()
    undecided = any(c.local_present for c in rows) or any(p.local_present for p in held)
    if undecided and not os.path.lexists(was):
        return
    versions: list[tuple[bool, Sequence[Recorded]]] = []
    for c in rows:
        if not c.local_present and (c.local_gone == "rotated" or getattr(
                latest_store_job(session, c.id), "state", None) in (S.ROTATED, S.FORGOTTEN)):
            by_host: dict[str | None, list[CheckpointFile]] = {}  # its own files, and each host's part of it
            for f in c.files:
                by_host.setdefault(f.host, []).append(f)
            versions += [(c.is_dir if h is None else True, files) for h, files in by_host.items()]
    versions += [(True, [_Kept.of_part(f) for f in p.files]) for p in held if not p.local_present]
    if any(changed_since_detection(entry, is_dir, files) is None for is_dir, files in versions):
        trash.remove(entry)
        log.info("removed %s, left by a rotation that committed", entry)
        return
    back = trash.restore(entry, was)
    log.warning("%s holds files no rotated version of %s has (a save that landed there as its rotation was "
                "interrupted); not deleted: put back at %s", entry, was, back)


def unsafe_reason(session: Session, settings: Settings, checkpoint_id: int, job_id: int) -> str | None:
    """Why deleting the local copy is not allowed now, or None if invariant 1 holds."""
    done = states.TERMINAL[JobKind.RESTORE] | states.TERMINAL[JobKind.STORE] | {S.VERIFIED.value}
    active = session.scalar(
        select(Job.id).where(Job.checkpoint_id == checkpoint_id, Job.id != job_id, Job.state.not_in(sorted(done)))
        .limit(1)
    )
    ckpt = session.get(Checkpoint, checkpoint_id)
    changed = changed_since_detection(Path(ckpt.path), ckpt.is_dir, own_files(ckpt)) if ckpt is not None else None
    return copies.deletion_blocker(
        shard_copies(session, checkpoint_id), need=settings.need_for(ckpt.run if ckpt is not None else ""),
        fresh_after=fresh_after(settings.freshness_seconds), active_job=active, changed=changed,
    )


def confirm_with_workers(settings: Settings, checkpoint_id: int) -> str | None:
    """Ask the workers whether they still hold the copies that count, at the right size.

    Only good, fresh copies are asked about; each shard needs RF confirmed copies. A
    worker that cannot answer confirms nothing.
    """
    since = fresh_after(settings.freshness_seconds)
    with session_scope(settings.db_url) as s:
        shards = shard_copies(s, checkpoint_id)
        urls = {w.id: w.url for w in s.scalars(select(StorageWorker))}
        need = settings.need_for(one(s, Checkpoint, checkpoint_id).run)
    answers: dict[str, dict[str, int | None] | str] = {}
    for worker_id, sizes in copies.to_confirm(shards, since, need).items():
        try:
            answers[worker_id] = client_for(settings, worker_id, urls[worker_id]).stat(sorted(sizes))
        except (WorkerError, ObjectStoreError) as exc:
            answers[worker_id] = exc.reason
    return copies.confirmation_blocker(shards, answers, need=need, fresh_after=since)


def rotate(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.state not in ROTATABLE:
            return []
        ckpt = one(s, Checkpoint, job.checkpoint_id)
        if not ckpt.local_present:
            return []
        if owner_elsewhere(s, ckpt.id, settings.host_id):
            # Its files are on another host: deleting nothing here must not count as rotated.
            return [Send("rotate", (job_id,))]
        if job.checkpoint_id not in rotation_candidates(s, ckpt.run, settings.keep_last, settings.host_id):
            return []
        checkpoint_id, path = ckpt.id, ckpt.path
        reason = unsafe_reason(s, settings, checkpoint_id, job_id)
    reason = reason or confirm_with_workers(settings, checkpoint_id)
    if reason:
        _block(settings, job_id, reason)
        return []

    base = roots.base_for(Path(os.path.dirname(path)), settings.roots)
    if base is None:  # never delete through a path that no longer leads inside a watched root
        _block(settings, job_id, f"{path} is no longer inside a watched root (a link on its path leads out)")
        return []
    trashed = None
    try:
        with session_scope(settings.db_url) as s:
            # The deciding transaction (BEGIN IMMEDIATE on SQLite, the job row locked on
            # PostgreSQL): nothing changes under it, and a duplicate delivery waits, then
            # finds the job rotated.
            job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
            ckpt = s.scalars(select(Checkpoint).where(Checkpoint.id == checkpoint_id).with_for_update()).one()
            if job.state not in ROTATABLE or not ckpt.local_present:
                return []
            state, ckpt_is_dir = job.state, ckpt.is_dir
            if put_back(path, file_sig(ckpt)):  # a rotation crashed after its rename, before its commit
                log.warning("job %d: %s was in the trash of a rotation that did not commit; put back", job_id, path)
            reason = unsafe_reason(s, settings, checkpoint_id, job_id)
            if reason is None:
                files = [_Kept.of(f) for f in own_files(ckpt)]
                trashed, back = _trash_if_unchanged(path, base, ckpt.is_dir, files)
                if back is not None:
                    reason = _replaced(path, back)
            if reason is None:
                ckpt.local_present, ckpt.local_gone = False, "rotated"
                if state != S.VERIFIED:  # forgotten, or rotated before: it stays as it is
                    job.blocked_reason = None
                    why = ("collected with the next garbage collection: it was forgotten" if state == S.FORGOTTEN
                           else "it had come back after its rotation")
                    note(s, job_id, f"local copy removed by the local policy; {settings.rf_for(ckpt.run)}+ verified "
                                    f"replicas remained ({why})")
                else:
                    transition(s, job_id, JobKind.STORE, S.VERIFIED, S.ROTATED, blocked_reason=None,
                               detail=f"local copy removed; {settings.rf_for(ckpt.run)}+ verified replicas remain")
    except OutsideRoots:  # retargeted between the check above and the rename: nothing moved
        _block(settings, job_id, f"{path} is no longer inside a watched root (a link on its path leads out)")
        return []
    except BaseException:
        if trashed is not None:
            trash.restore(trashed, path)  # undo: the transaction that allowed it did not commit
        raise
    if reason:
        _block(settings, job_id, reason)
        return []
    if trashed is not None:
        _remove_if_unchanged(job_id, trashed, path, base, ckpt_is_dir, files)
    log.info("rotated %s (job %d)", path, job_id)
    with session_scope(settings.db_url) as s:  # and the parts other hosts hold of it, there
        return [Send("rotate_part", (job_id, h)) for h in s.scalars(
            select(CheckpointPart.host).where(CheckpointPart.checkpoint_id == checkpoint_id,
                                              CheckpointPart.local_present.is_(True)))]


def rotate_part(settings: Settings, job_id: int, host: str) -> list[Send]:
    """Remove ``host``'s part of a checkpoint its coordinator's host rotated (docs/design.md,
    "One checkpoint, several hosts"): one decision for the whole checkpoint, taken by
    :func:`rotate`; each host deletes its own files, inside a transaction that sees the
    rule of invariant 1 hold again and the part as it was stored."""
    if host != settings.host_id:
        return [Send("rotate_part", (job_id, host))]  # its files are on that host: sent there
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.checkpoint_id is None or not _coordinator_rotated(s, job):
            return []
        checkpoint_id = job.checkpoint_id
    # As rotate does: the workers confirm they hold every copy that counts, right before the
    # deciding transaction (which sees the rule hold again on the rows).
    reason = confirm_with_workers(settings, checkpoint_id)
    if reason:
        _block(settings, job_id, f"{host}'s part: {reason}")
        return []
    trashed, base = None, None
    try:
        with session_scope(settings.db_url) as s:
            job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
            if job is None or job.checkpoint_id != checkpoint_id or not _coordinator_rotated(s, job):
                return []
            part = s.scalars(select(CheckpointPart).where(
                CheckpointPart.checkpoint_id == job.checkpoint_id, CheckpointPart.host == host,
                CheckpointPart.local_present.is_(True)).with_for_update()).one_or_none()
            if part is None:
                return []
            path = part.path
            base = roots.base_for(Path(os.path.dirname(path)), settings.roots)
            if base is None:  # never delete through a path that no longer leads inside a watched root
                raise OutsideRoots(path, [str(r) for r in settings.roots])
            if put_back(path, parts.file_sig(part)):
                log.warning("job %d: %s was in the trash of a rotation that did not commit; put back", job_id, path)
            ckpt = one(s, Checkpoint, job.checkpoint_id)
            mine = [f for f in ckpt.files if f.host == host]
            reason = copies.deletion_blocker(
                shard_copies(s, ckpt.id), need=settings.need_for(ckpt.run),
                fresh_after=fresh_after(settings.freshness_seconds),
                active_job=None, changed=changed_since_detection(Path(path), True, mine))
            if reason is None:
                files = [_Kept.of(f) for f in mine]
                trashed, back = _trash_if_unchanged(path, base, True, files)
                if back is not None:
                    reason = _replaced(path, back)
            if reason is None:
                part.local_present = False
                job.blocked_reason = None
                note(s, job_id, f"{host}'s part removed from {path}")
    except OutsideRoots:  # nothing moved
        _block(settings, job_id, f"{host}'s part: {path} is no longer inside a watched root (a link on its path "
                                 "leads out)")
        return []
    except BaseException:
        if trashed is not None:
            trash.restore(trashed, path)  # undo: the transaction that allowed it did not commit
        raise
    if reason:
        _block(settings, job_id, f"{host}'s part: {reason}")
        return []
    if trashed is not None:
        _remove_if_unchanged(job_id, trashed, path, base, True, files)
    log.info("removed this host's part of %s (job %d)", path, job_id)
    return []


@dataclass(frozen=True)
class _Kept:
    """A recorded file as rotation checked it, kept past the deciding transaction."""

    relpath: str
    size: int
    mtime_ns: int
    sha256: str

    @classmethod
    def of(cls, f: CheckpointFile) -> _Kept:
        return cls(f.relpath, f.size, f.mtime_ns, f.sha256)

    @classmethod
    def of_part(cls, f: dict[str, Any]) -> _Kept:
        """A file of a part as its host announced it (pipeline.detection.parts)."""
        return cls(str(f["relpath"]), int(f["size"]), int(f["mtime_ns"]), str(f.get("sha256") or ""))


def _trash_if_unchanged(path: str, base: Path, is_dir: bool,
                        files: list[_Kept]) -> tuple[str | None, Path | None]:
    """Rename the checkpoint at ``path`` into the trash and check that what moved is what was
    stored: the check before it looked at the path, and a save that landed there in between (a
    trainer renaming a new save over it) would otherwise be deleted. ``(trash entry, None)``;
    ``(None, None)`` if nothing was there; ``(None, where)`` when what moved is not what was
    stored: put back at ``path``, or beside it if another save took the path meanwhile."""
    if not os.path.lexists(path):
        return None, None
    failpoints.hit(f"rotate.trash.{Path(path).name}")
    trashed = move_to_trash(Path(path), inside=base)
    try:
        changed = changed_since_detection(Path(trashed), is_dir, files)
    except BaseException:
        trash.restore(trashed, path)
        raise
    if changed is None:
        return trashed, None
    return None, trash.restore(trashed, path)


def _replaced(path: str, back: Path) -> str:
    where = "put back" if str(back) == path else f"kept as {back} (another save took its path)"
    return f"{path} changed while it was being rotated (a new save over it); not deleted: {where}"


def _remove_if_unchanged(job_id: int, trashed: str, path: str, base: Path, is_dir: bool, files: list[_Kept]) -> None:
    """Delete a committed rotation's trash entry, unless it changed since it was checked (a
    writer that held a file of it open wrote to it): then it goes back, never deleted, and the
    watcher finds it as a new save."""
    failpoints.hit(f"rotate.remove.{Path(path).name}")
    if changed_since_detection(Path(trashed), is_dir, files) is None:
        trash.remove(Path(trashed), inside=base)
        return
    back = trash.restore(trashed, path)
    log.warning("job %d: %s was written to after its rotation was decided; not deleted, put back at %s",
                job_id, path, back)


def _block(settings: Settings, job_id: int, reason: str) -> None:
    text = f"rotation blocked: {reason}"
    with session_scope(settings.db_url) as s:
        job = s.get(Job, job_id)
        if job is not None and job.blocked_reason != text:
            job.blocked_reason = text
            note(s, job_id, text)
    log.warning("job %d: %s", job_id, text)
