"""Restore: give a checkpoint back byte for byte (``queued -> gathering -> verified -> done``).

Files are rebuilt (pipeline.restoring.rebuild) in a hidden staging path next to the
destination, checked against the SHA-256 recorded at detection, fsynced, and only then
renamed into place (docs/design.md, invariants 2 and 4). Each attempt has its own staging
path; only the job's latest attempt may put its result in place. The staging path is written
through descriptors (pipeline.restoring.staging), and the destination is checked again
(pipeline.restoring.destination) in the transaction that decides to write it (invariant 7).
Shards come from storage workers, or from an object store when no worker can send them
(pipeline.restoring.gather); the timeline says which tiers were read. An object store that
cannot serve them now (StoreUnavailable) fails the job at once, with nothing put in place.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db import hosts
from pipeline.db.engine import one, session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.db.transitions import create_job, renew_lease, transition
from pipeline.detection.catalog import latest_store_job, resolve
from pipeline.errors import RestoreError, StoreUnavailable, UnsafeDestination
from pipeline.restoring import current, destination
from pipeline.restoring.gather import FileSource, Tally, manifest
from pipeline.restoring.rebuild import write_file
from pipeline.restoring.staging import Staging, identity, remove_at
from pipeline.settings import Settings
from pipeline.states import JobKind
from pipeline.steps import Send, fail_job, start_job

log = logging.getLogger("ckpt.restore")
R = states.RestoreState
#: Told the bytes a restore has written so far and its total (from the fetching threads, one at a time).
Watch = Callable[[int, int], None]


def request(session: Session, settings: Settings, ref: str | int, dest: str, *, overwrite: bool = False,
            extra_roots: Iterable[Path] = (), host: str | None = None) -> Job:
    """Validate a restore request and create its job (the caller enqueues ``restore``).

    ``host``: where the restore runs and ``dest`` is (default this host); its queue must have a
    live consumer (:class:`NoConsumer` otherwise). ``extra_roots``: directories this caller may
    also restore under (its current directory); they go with the job, so the actor checks the
    destination against the same roots. Another host's destination is checked there, by the
    actor, against that host's roots and disk."""
    host = host or settings.host_id
    if host == settings.host_id:
        extra = [p.resolve() for p in extra_roots]
        ckpt, target = validate(session, settings, ref, dest, overwrite=overwrite, extra_roots=extra)
        seen: dict[str, object] = {"seen": destination.seen(target)}
    else:
        extra, seen = [], {}  # this caller's directory is not a place on that host
        ckpt, target = validate_elsewhere(session, ref, dest, host)
    hosts.require_consumer(session, settings, host)
    params: dict[str, object] = {"dest": str(target), "overwrite": overwrite, "host": host,
                                 "asked_on": settings.host_id, **seen}
    if extra:
        params["extra_roots"] = [str(p) for p in extra]
    return create_job(session, JobKind.RESTORE, checkpoint_id=ckpt.id, lease_seconds=settings.lease_seconds,
                      params=params, bytes_total=ckpt.total_bytes, detail=f"restore to {target} on {host}")


def validate(session: Session, settings: Settings, ref: str | int, dest: str, *, overwrite: bool = False,
             extra_roots: Iterable[Path] = ()) -> tuple[Checkpoint, Path]:
    """The checkpoint and resolved destination of a restore on this host that may go ahead;
    raises the reason it may not (what a form checks before it is submitted, and :func:`request`).

    An existing destination is examined as the actor will examine it, except that a file
    whose size and mtime equal its protected record is not read (the actor reads it)."""
    ckpt = resolve(session, ref, settings.host_id)
    target = Path(dest).expanduser().resolve()
    extra = list(extra_roots)
    destination.check(session, settings, target, extra)
    if destination.existing(session, settings, target, overwrite=overwrite, extra_roots=extra):
        destination.examine(lambda: nullcontext(session), settings, target, trust_stat=True)
    if not target.parent.is_dir():
        raise RestoreError(f"{target.parent} is not a directory; create it first")
    _restorable(session, ckpt)
    if not str(ref).isdigit():  # by path: the version on disk there, or a refusal that says why
        current.check(settings, ckpt, target)
    current.check_target(session, settings, ckpt, target, Path(dest).expanduser().absolute())
    return ckpt, target


def validate_elsewhere(session: Session, ref: str | int, dest: str, host: str) -> tuple[Checkpoint, Path]:
    """The checkpoint and destination of a restore on another ``host``: what the control plane
    can tell from here (the checkpoint is restorable, the path is absolute). Its disk, its
    restore roots and what is at ``dest`` are that host's: its actor checks them before
    fetching anything, and refuses with the reason (docs/design.md, invariant 7)."""
    ckpt = resolve(session, ref, host)
    if not os.path.isabs(dest):
        raise RestoreError(f"{dest} is not an absolute path: give the destination as a full path on host {host}")
    _restorable(session, ckpt)
    return ckpt, Path(os.path.normpath(dest))


def _restorable(session: Session, ckpt: Checkpoint) -> None:
    """Raise why ``ckpt`` cannot be restored (forgotten, or not replicated yet)."""
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


def restore(settings: Settings, job_id: int, watch: Watch | None = None) -> list[Send]:
    """Run restore job ``job_id`` here: the step of the ``restore`` actor, and of a caller that
    restores on its own host (pipeline.operations.restore_here); ``watch`` sees its progress."""
    with session_scope(settings.db_url) as s:
        runs_on = (s.scalar(select(Job.params).where(Job.id == job_id)) or {}).get("host")
        if runs_on not in (None, settings.host_id):
            return [Send("restore", (job_id,))]  # its destination is on the host that asked: sent there
        job = start_job(s, settings, job_id, JobKind.RESTORE, R.QUEUED, R.GATHERING)
        if job is None:
            return []
        ckpt = one(s, Checkpoint, job.checkpoint_id)
        files = manifest(s, ckpt)
        is_dir, dest, overwrite = ckpt.is_dir, Path(job.params["dest"]), bool(job.params.get("overwrite"))
        extra = [Path(p) for p in job.params.get("extra_roots", ())]
        # Each attempt (a redelivery, or a re-drive while a stalled attempt still runs)
        # rebuilds in its own staging path and may put it in place only while it is the
        # job's latest attempt: two attempts never write the same file.
        attempt, verified = job.attempts, job.params.get("staging")
        resumed = job.state == R.VERIFIED  # a crash came after the files were verified
        if not resumed:  # refused before anything is fetched; checked again before writing
            try:
                if job.params.get("asked_on", settings.host_id) != settings.host_id:
                    _here(dest)  # asked from another host: nothing there saw this path
                destination.check(s, settings, dest, extra)
                current.check_target(s, settings, ckpt, dest)
                destination.existing(s, settings, dest, overwrite=overwrite, extra_roots=extra)
                if "seen" in job.params and destination.seen(dest) != job.params["seen"]:
                    raise UnsafeDestination(f"{dest} changed since the restore was asked (saved again there?): "
                                            f"what is there now is not what was asked to be replaced; "
                                            f"{destination.INSTEAD}")
            except RestoreError as exc:
                return _refuse(s, job_id, exc)

    old = f".{dest.name}.ckpt-old-{job_id}"
    done = sum(f.size for f in files)
    try:
        staging = _staging(settings, job_id, attempt, files, dest, is_dir, resumed, verified, watch)
    except UnsafeDestination as exc:
        with session_scope(settings.db_url) as s:
            return _refuse(s, job_id, exc)
    except StoreUnavailable as exc:  # a retry now would meet the same store: the operator acts first
        with session_scope(settings.db_url) as s:
            fail_job(s, job_id, str(exc))
        log.warning("job %d: %s", job_id, exc)
        return []
    if staging is None:
        return []
    try:
        done = staging.done or done
        return _put_in_place(settings, job_id, attempt, staging, dest, old, files, overwrite, extra, done)
    finally:
        staging.close()


class _Staged(Staging):
    """A staging entry and the bytes its attempt wrote (0: adopted or already in place)."""

    done = 0
    in_place = False


def _staging(settings: Settings, job_id: int, attempt: int, files: list[FileSource], dest: Path, is_dir: bool,
             resumed: bool, verified: str | None, watch: Watch | None) -> _Staged | None:
    """The verified staging entry to put in place: this attempt's, or the one a crashed
    attempt verified; None if a later attempt took the job over meanwhile."""
    if resumed and verified:
        adopted = _Staged(dest.parent, Path(verified).name, is_dir=is_dir)
        if adopted.adopt() and _holds(Path(verified), files, is_dir):
            return adopted
        adopted.in_place = adopted.made is None and _holds(dest, files, is_dir)  # only the record was lost
        if adopted.in_place:
            return adopted
        adopted.close()
    staged = _Staged(dest.parent, f".{dest.name}.ckpt-restore-{job_id}.{attempt}", is_dir=is_dir)
    try:
        gathered = _gather(settings, job_id, attempt, files, staged, watch)
    except BaseException:
        staged.close()
        raise
    if gathered is None:
        staged.close()
        return None
    staged.done = gathered
    return staged


def _put_in_place(settings: Settings, job_id: int, attempt: int, staging: _Staged, dest: Path, old: str,
                  files: list[FileSource], overwrite: bool, extra: list[Path], done: int) -> list[Send]:
    """Check the destination again and, in the transaction that decides it, rename the
    verified staging entry to ``dest`` (an existing ``dest`` set aside first, then removed)."""
    pfd = staging.parent_fd
    found: destination.Replaceable | None = None
    try:
        if overwrite and not staging.in_place and os.path.lexists(dest):
            # Read with no transaction open: every byte of what an overwrite would replace.
            found = destination.examine(lambda: session_scope(settings.db_url, readonly=True), settings, dest,
                                        trust_stat=False)
    except RestoreError as exc:
        with session_scope(settings.db_url) as s:
            return _refuse(s, job_id, exc, staging)
    with session_scope(settings.db_url) as s:
        # The deciding transaction: only the latest attempt puts its result in place, and
        # only where the destination rules allow it now.
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
        if job.state != R.VERIFIED or job.attempts != attempt:
            if staging.made is not None and staging.name != Path(job.params.get("staging") or "").name:
                _remove_ours(staging)
            log.info("job %d: attempt %d superseded by attempt %d; leaving it", job_id, attempt, job.attempts)
            return []
        if not staging.in_place:
            try:
                _recheck(s, settings, dest, found, overwrite, extra)
                staging.still_ours()
                if found is not None:
                    os.rename(dest.name, old, src_dir_fd=pfd, dst_dir_fd=pfd)
                    try:
                        destination.unchanged(found, dest.parent / old)  # what was set aside is what was examined
                    except RestoreError:
                        os.rename(old, dest.name, src_dir_fd=pfd, dst_dir_fd=pfd)
                        raise
                os.rename(staging.name, dest.name, src_dir_fd=pfd, dst_dir_fd=pfd)
                os.fsync(pfd)
            except RestoreError as exc:
                return _refuse(s, job_id, exc, staging)
        remove_at(pfd, old)  # set aside above, or by an attempt that crashed between the two renames
        prefix = f".{glob.escape(dest.name)}.ckpt-restore-{job_id}.*"
        for stale in os.listdir(pfd):
            if fnmatch.fnmatchcase(stale, prefix):
                remove_at(pfd, stale)  # of attempts that crashed (or stalled and lost the job)
        read = job.params.get("read")
        transition(s, job_id, JobKind.RESTORE, R.VERIFIED, R.DONE,
                   detail=f"restored to {dest}" + (f": {read}" if read else ""))
    log.info("job %d: restored checkpoint to %s (%d bytes; %s)", job_id, dest, done, read or "")
    return []


def _here(dest: Path) -> None:
    """Refuse a destination asked from another host that does not name itself on this one
    (relative, or through a link): the request checked nothing on this disk."""
    if not dest.is_absolute() or dest.parent.resolve() != dest.parent:
        raise UnsafeDestination(f"{dest} passes through a link on this host (it is "
                                f"{dest.parent.resolve() / dest.name}); give the real path")
    if not dest.parent.is_dir():
        raise RestoreError(f"{dest.parent} is not a directory on this host; create it first")


def _recheck(session: Session, settings: Settings, dest: Path, found: destination.Replaceable | None,
             overwrite: bool, extra: list[Path]) -> None:
    """The destination rules again, now (docs/design.md, invariant 7)."""
    destination.check(session, settings, dest, extra)
    if destination.existing(session, settings, dest, overwrite=overwrite, extra_roots=extra):
        if found is None:
            raise UnsafeDestination(f"{dest} appeared while restoring; left it as it is; {destination.INSTEAD}")
        destination.unchanged(found)


def _refuse(session: Session, job_id: int, exc: RestoreError, staging: Staging | None = None) -> list[Send]:
    """Fail the job with the reason its destination may not be written (never retried)."""
    if staging is not None and staging.made is not None:
        _remove_ours(staging)
    fail_job(session, job_id, f"refused: {exc}")
    log.warning("job %d: %s", job_id, exc)
    return []


def _gather(settings: Settings, job_id: int, attempt: int, files: list[FileSource], staging: _Staged,
            watch: Watch | None) -> int | None:
    """Rebuild every file in ``staging``, verified and fsynced, and move the job to
    ``verified``; None if a later attempt took the job over meanwhile."""
    key = settings.key()
    tally = Tally()
    done, total = 0, sum(f.size for f in files)
    renew_every = max(0.5, settings.lease_seconds / 4)
    last_renewal = time.monotonic()

    def progress(n: int) -> None:
        nonlocal done, last_renewal
        done += n
        if watch is not None:
            watch(done, total)
        if time.monotonic() - last_renewal >= renew_every:
            last_renewal = time.monotonic()
            with session_scope(settings.db_url) as s2:
                renew_lease(s2, job_id, settings.lease_seconds, bytes_done=done)

    try:
        staging.create()
        if staging.is_dir:
            for f in files:
                dir_fd, name = staging.place(f.relpath)
                write_file(f, name, key, progress, wire=settings.wire_compression, dir_fd=dir_fd, settings=settings,
                           tally=tally)
            staging.fsync()
        else:
            made = write_file(files[0], staging.name, key, progress, wire=settings.wire_compression,
                              dir_fd=staging.parent_fd, settings=settings, tally=tally)
            staging.made = identity(made)
        staging.still_ours()
        os.fsync(staging.parent_fd)
    except BaseException:
        if staging.made is not None:
            _remove_ours(staging)
        elif not staging.is_dir:  # a file this attempt created (O_EXCL) and did not finish
            remove_at(staging.parent_fd, staging.name)
        raise
    with session_scope(settings.db_url) as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
        if job.attempts != attempt or job.state != R.GATHERING:
            _remove_ours(staging)
            return None
        read = tally.summary()
        transition(s, job_id, JobKind.RESTORE, R.GATHERING, R.VERIFIED, lease_seconds=settings.lease_seconds,
                   detail=f"{matching(len(files))}; {read}", bytes_done=done, attempts=attempt,
                   params={**job.params, "staging": str(staging.parent / staging.name), "read": read})
    return done


def _remove_ours(staging: Staging) -> None:
    """Remove the staging entry if it still is the one this attempt made (a link or an entry
    put in its place is left alone: it is not ours, and following it could reach anywhere)."""
    try:
        staging.still_ours()
    except RestoreError:
        return
    remove_at(staging.parent_fd, staging.name)


def matching(n: int) -> str:
    return f"{n} files match their recorded SHA-256" if n != 1 else "1 file matches its recorded SHA-256"


def _holds(dest: Path, files: list[FileSource], is_dir: bool) -> bool:
    """Whether ``dest`` is exactly the restored checkpoint: its files, no link among them, each
    hashing as recorded."""
    try:
        found = dict(destination.walk(dest))
    except (OSError, RestoreError):
        return False
    if set(found) != {f.relpath if is_dir else "" for f in files}:
        return False
    for f in files:
        rel = f.relpath if is_dir else ""
        if found[rel].st_size != f.size:
            return False
        try:
            fd = os.open(dest / rel if rel else dest, os.O_RDONLY | os.O_NOFOLLOW)
            with open(fd, "rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() != f.sha256:
                    return False
        except OSError:
            return False
    return True
