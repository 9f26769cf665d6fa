"""Restore: give a checkpoint back byte for byte (``queued -> gathering -> verified -> done``).

Files are rebuilt (pipeline.restore.rebuild) in a hidden staging path next to the
destination, checked against the SHA-256 recorded at detection, fsynced, and only then
renamed into place (docs/design.md, invariants 2 and 4). Each attempt has its own staging
path; only the job's latest attempt may put its result in place.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.db.transitions import create_job, renew_lease, transition
from pipeline.detection.catalog import latest_store_job, resolve
from pipeline.durable import fsync_dir
from pipeline.errors import DestinationExists, RestoreError
from pipeline.restore import current, destination
from pipeline.restore.gather import FileSource, manifest
from pipeline.restore.rebuild import fsync_tree, write_file
from pipeline.settings import Settings
from pipeline.states import JobKind
from pipeline.steps import Send, start_job

log = logging.getLogger("ckpt.restore")
R = states.RestoreState


def request(session: Session, settings: Settings, ref: str | int, dest: str, *, overwrite: bool = False,
            extra_roots: Iterable[Path] = ()) -> Job:
    """Validate a restore request and create its job (the caller enqueues ``restore``).

    ``extra_roots``: directories this caller may also restore under (its current directory)."""
    ckpt, target = validate(session, settings, ref, dest, overwrite=overwrite, extra_roots=extra_roots)
    return create_job(session, JobKind.RESTORE, checkpoint_id=ckpt.id, lease_seconds=settings.lease_seconds,
                      params={"dest": str(target), "overwrite": overwrite, "host": settings.host_id},
                      bytes_total=ckpt.total_bytes,
                      detail=f"restore to {target}")


def validate(session: Session, settings: Settings, ref: str | int, dest: str, *, overwrite: bool = False,
             extra_roots: Iterable[Path] = ()) -> tuple[Checkpoint, Path]:
    """The checkpoint and resolved destination of a restore that may go ahead; raises the
    reason it may not (what a form checks before it is submitted, and :func:`request`)."""
    ckpt = resolve(session, ref, settings.host_id)
    target = Path(dest).expanduser().resolve()
    destination.check(session, settings, target, extra_roots)
    if target.exists() and not overwrite:
        raise DestinationExists(str(target))
    if not target.parent.is_dir():
        raise RestoreError(f"{target.parent} is not a directory; create it first")
    store = latest_store_job(session, ckpt.id)
    if store is not None and store.state == states.StoreState.FORGOTTEN:
        when = ckpt.released_at.isoformat(timespec="seconds") if ckpt.released_at else "earlier"
        local = " (its local copy is still there)" if ckpt.local_present else ""
        raise RestoreError(f"checkpoint {ckpt.id} ({ckpt.path}) was forgotten {when} by the remote retention "
                           f"policy or `ckpt forget`: its remote copies are deleted or being deleted, so it cannot "
                           f"be restored{local}; `ckpt status --all` lists the checkpoints that can")
    if store is None or store.state not in states.RESTORABLE:
        state = store.state if store else "unknown"
        raise RestoreError(f"checkpoint {ckpt.id} is {state}: only replicated or verified checkpoints can be restored")
    if not str(ref).isdigit():  # by path: the version on disk there, or a refusal that says why
        current.check(settings, ckpt, target)
    return ckpt, target


def restore(settings: Settings, job_id: int) -> list[Send]:
    with session_scope(settings.db_url) as s:
        asked_on = (s.scalar(select(Job.params).where(Job.id == job_id)) or {}).get("host")
        if asked_on not in (None, settings.host_id):
            return [Send("restore", (job_id,))]  # its destination is on the host that asked: sent there
        job = start_job(s, settings, job_id, JobKind.RESTORE, R.QUEUED, R.GATHERING)
        if job is None:
            return []
        ckpt = one(s, Checkpoint, job.checkpoint_id)
        files = manifest(s, ckpt)
        is_dir, dest, overwrite = ckpt.is_dir, Path(job.params["dest"]), bool(job.params.get("overwrite"))
        # Each attempt (a redelivery, or a re-drive while a stalled attempt still runs)
        # rebuilds in its own staging path and may put it in place only while it is the
        # job's latest attempt: two attempts never write the same file.
        attempt, verified = job.attempts, job.params.get("staging")
        resumed = job.state == R.VERIFIED  # a crash came after the files were verified

    old = dest.parent / f".{dest.name}.ckpt-old-{job_id}"
    done = sum(f.size for f in files)
    if resumed and verified and Path(verified).exists():
        staging: Path | None = Path(verified)
    elif resumed and not old.exists() and _holds(dest, files, is_dir):
        staging = None  # already in place: only the record of it was lost
    else:
        staging = dest.parent / f".{dest.name}.ckpt-restore-{job_id}.{attempt}"
        gathered = _gather(settings, job_id, attempt, files, staging, is_dir)
        if gathered is None:
            return []
        done = gathered
    with session_scope(settings.db_url) as s:
        # The deciding transaction: only the latest attempt puts its result in place.
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
        if job.state != R.VERIFIED or job.attempts != attempt:
            if staging is not None and str(staging) != job.params.get("staging"):
                _remove(staging)
            log.info("job %d: attempt %d superseded by attempt %d; leaving it", job_id, attempt, job.attempts)
            return []
        if staging is not None and staging.exists():
            _put_in_place(staging, dest, old, overwrite)
        if old.exists():  # the crash came between the two renames of an overwrite
            _remove(old)
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.ckpt-restore-{job_id}.*"):
            _remove(stale)  # of attempts that crashed (or stalled and lost the job)
        transition(s, job_id, JobKind.RESTORE, R.VERIFIED, R.DONE, detail=f"restored to {dest}")
    log.info("job %d: restored checkpoint to %s (%d bytes)", job_id, dest, done)
    return []


def _gather(settings: Settings, job_id: int, attempt: int, files: list[FileSource], staging: Path,
            is_dir: bool) -> int | None:
    """Rebuild every file under ``staging``, verified and fsynced, and move the job to
    ``verified``; None if a later attempt took the job over meanwhile."""
    _remove(staging)  # a leftover of a crashed attempt, or a symlink planted at this predictable name
    key = settings.key()
    done = 0
    renew_every = max(0.5, settings.lease_seconds / 4)
    last_renewal = time.monotonic()

    def progress(n: int) -> None:
        nonlocal done, last_renewal
        done += n
        if time.monotonic() - last_renewal >= renew_every:
            last_renewal = time.monotonic()
            with session_scope(settings.db_url) as s2:
                renew_lease(s2, job_id, settings.lease_seconds, bytes_done=done)

    try:
        if is_dir:
            staging.mkdir()
            for f in files:
                out = staging / f.relpath
                out.parent.mkdir(parents=True, exist_ok=True)
                write_file(f, out, key, progress, wire=settings.wire_compression)
            fsync_tree(staging)
        else:
            write_file(files[0], staging, key, progress, wire=settings.wire_compression)
    except BaseException:
        _remove(staging)
        raise
    with session_scope(settings.db_url) as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
        if job.attempts != attempt or job.state != R.GATHERING:
            _remove(staging)
            return None
        transition(s, job_id, JobKind.RESTORE, R.GATHERING, R.VERIFIED, lease_seconds=settings.lease_seconds,
                   detail=matching(len(files)), bytes_done=done,
                   attempts=attempt, params={**job.params, "staging": str(staging)})
    return done


def matching(n: int) -> str:
    return f"{n} files match their recorded SHA-256" if n != 1 else "1 file matches its recorded SHA-256"


def _put_in_place(staging: Path, dest: Path, old: Path, overwrite: bool) -> None:
    """Rename the verified ``staging`` to ``dest`` (the old ``dest`` set aside first)."""
    if dest.exists():
        if not overwrite:
            raise RestoreError(f"{dest} appeared while restoring; left the result at {staging}")
        os.rename(dest, old)
    os.rename(staging, dest)
    fsync_dir(dest.parent)


def _holds(dest: Path, files: list[FileSource], is_dir: bool) -> bool:
    """Whether ``dest`` already is the restored checkpoint (its files hash as recorded)."""
    for f in files:
        path = dest / f.relpath if is_dir else dest
        try:
            if os.path.getsize(path) != f.size:
                return False
            with open(path, "rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() != f.sha256:
                    return False
        except OSError:
            return False
    return True


def _remove(path: Path) -> None:
    """Remove a file or a directory tree at ``path``; a symlink is removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
