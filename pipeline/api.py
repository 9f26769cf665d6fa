"""The Python API a training script uses: protect, latest, restore (and load_state_dict).

These run in the trainer's process against the control plane of ``CKPT_HOME`` (or the
``settings`` given): a ``ckpt up`` on the machine, or a deployment's database and Redis.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline import settings as settings_mod
from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.errors import CkptError, NotProtectedYet, RestoreError, UnknownCheckpoint
from pipeline.protector import Declared, Protector
from pipeline.settings import Settings
from pipeline.states import JobKind

_ready: set[str] = set()


def _control_plane(settings: Settings | None) -> Settings:
    """The settings, with the schema at head and the broker installed (once per process)."""
    s = settings or settings_mod.current()
    if s.db_url not in _ready:
        from pipeline.db.migrate import upgrade

        upgrade(s.db_url)
        _ready.add(s.db_url)
    import pipeline.tasks  # noqa: F401  (installs the broker the messages go through)

    return s


@dataclass(frozen=True)
class Protected:
    """A checkpoint as the control plane records it."""

    id: int
    path: str
    run: str
    step: int | None
    state: str
    written_at: datetime  # its newest file's modification time
    job_id: int | None = None
    #: The other files of this save, when it wrote several side by side into its run
    #: (``save_pretrained(run, max_shard_size=...)``: this is the index, these are its shards,
    #: each a checkpoint of its own): :func:`restore` gives all of them back.
    parts: tuple[Protected, ...] = ()

    @property
    def protected(self) -> bool:
        return self.state in states.PROTECTED


def protect(path: str | Path, *, settings: Settings | None = None) -> Declared:
    """Declare the checkpoint at ``path`` complete: it is recorded (complete by declaration)
    and its store started in the background, by this process's protector thread.

    Call it when the writer has finished (a Trainer's ``on_save``): no layout marker or quiet
    period is waited for. Returns at once, whatever happens next: the trainer's thread never
    hashes and never waits on the control plane, and a failure (no home, no ``ckpt up``, a path
    outside the watched roots) is logged once per run, shown as "protection degraded" and never
    raised here (pipeline.protector). ``.result()`` waits for the record and raises what
    stopped it; :func:`wait_protected` waits for the copies. Without ``settings``, the home is
    found as the ``ckpt`` commands find it (pipeline/home.py).
    """
    return protector().declare(path, settings)


def record(path: str | Path, settings: Settings) -> Protected:
    """Record the checkpoint at ``path`` now, complete by declaration, and start its store
    (what the protector thread does for each declaration; ``ckpt store PATH`` from Python)."""
    from pipeline import operations

    s = _control_plane(settings)
    try:
        r = operations.store(s, str(path), detail="declared complete by pipeline.protect")
    except CkptError:
        if os.path.lexists(path):
            raise
        known = _recorded_before(s, path)
        if known is None:
            raise
        return known
    if r.checkpoint_id is None:
        raise CkptError(f"{path}: nothing was recorded")
    if not r.sent:  # recorded, safe in the control plane; the protection itself waits for `ckpt up`
        raise CkptError(f"{path} is recorded, but the broker of `ckpt up` does not answer (is `ckpt up` "
                        "running?): its store starts once it is back")
    return _describe(s, r.checkpoint_id)


def _recorded_before(s: Settings, path: str | Path) -> Protected | None:
    """A save gone from disk before (or while) it was recorded here, which the control plane
    already holds, protected or on its way (the watcher found it complete first, then local
    rotation removed it once newer ones were protected): nothing failed."""
    try:
        p = _describe(s, str(path))
    except UnknownCheckpoint:
        return None
    return p if p.protected or p.state not in states.TERMINAL[JobKind.STORE] else None


_protector: Protector | None = None


def protector() -> Protector:
    """This process's protector (created, with its thread, on first use)."""
    global _protector
    if _protector is None:
        from pipeline.recorder import Recorder

        # Records in a child process that lowers itself (CKPT_NICE); this thread only waits for it,
        # and must not renice itself: the child is forked from it and starts at its nice value.
        _protector = Protector(Recorder(), nice=0)
    return _protector


def _forked() -> None:
    """In a process just forked (a trainer's ``multiprocessing`` workers): the protector's thread
    and recorder are the parent's and do not run here; the next declaration starts this
    process's own. What the parent had declared is the parent's to wait for at exit."""
    global _protector
    if _protector is not None:
        _protector._latest = {}  # no lock: a thread of the parent may have held it at the fork
    _protector = None


os.register_at_fork(after_in_child=_forked)


def wait_protected(checkpoint: str | int | Path, *, timeout: float = 3600.0,
                   settings: Settings | None = None) -> Protected:
    """Wait until the checkpoint is protected (verified, RF copies); raise if its store ended otherwise."""
    deadline = time.monotonic() + timeout
    declared = protector().latest(checkpoint) if isinstance(checkpoint, str | Path) else None
    if declared is not None:  # declared here: recorded first (raises what stopped it)
        settings = settings or declared.settings
        declared.result(timeout)
    s = _control_plane(settings)
    while True:
        p = _describe(s, checkpoint)
        if p.protected:
            return p
        if p.state in states.TERMINAL[JobKind.STORE]:
            raise CkptError(f"checkpoint {p.id} ({p.path}) ended {p.state}: it is not protected")
        if time.monotonic() > deadline:
            raise NotProtectedYet(f"checkpoint {p.id} is still {p.state} after {timeout:.0f} s")
        time.sleep(0.1)


def latest(run: str | Path, *, settings: Settings | None = None) -> Protected | None:
    """The newest protected checkpoint of ``run`` (the most recently completed save:
    pipeline.core.retention.recency), or None. A save written as several files side by side
    into the run (``save_pretrained(run, max_shard_size=...)``) is returned as its index with
    its shards as :attr:`Protected.parts`, once every one of them is protected; until then the
    save before it is the newest."""
    from pipeline.db.newest import newest_protected
    from pipeline.detection.catalog import latest_store_job

    s = _control_plane(settings)
    run_path = str(Path(run).expanduser().resolve())
    with session_scope(s.db_url, readonly=True) as session:
        found = newest_protected(session, run_path)
        if found is None:
            return None
        ckpt, parts = found
        rows = []
        for c in (ckpt, *parts):
            job = latest_store_job(session, c.id)
            if job is None:  # its store job gone under this read: nothing to answer from it
                return None
            rows.append(_row(c, job))
        return dataclasses.replace(rows[0], parts=tuple(rows[1:]))


def restore(checkpoint: str | int | Path | Protected, to: str | Path, *, overwrite: bool = False,
            wait: bool = True, timeout: float = 3600.0, settings: Settings | None = None) -> Path:
    """Give a checkpoint back byte for byte at ``to`` (a checkpoint id, a path, which means its
    current version, or what :func:`latest` returned). Waits until it is in place unless
    ``wait`` is False. A save of several files (:attr:`Protected.parts`) goes back into the
    folder ``to``, each file under its own name, every file checked before any is written and
    its index written last (when waited for), as its writer did."""
    from pipeline import operations

    s = _control_plane(settings)
    if isinstance(checkpoint, Protected) and checkpoint.parts:
        folder = Path(to).expanduser()
        wanted = [(p.id, str(folder / Path(p.path).name)) for p in (*checkpoint.parts, checkpoint)]
        operations.check_restores(s, wanted, overwrite=overwrite, from_here=True)
        for part, dest in wanted:  # each recorded when its turn comes: a failure leaves the rest unrecorded
            r = operations.restore_to(s, part, dest, overwrite=overwrite, from_here=True, send=not wait)
            if wait:
                _restored(s, r.job_id, timeout)
        return folder.resolve()
    ref = checkpoint.id if isinstance(checkpoint, Protected) else str(checkpoint)
    r = operations.restore_to(s, ref, str(to), overwrite=overwrite, from_here=True, send=not wait)
    if wait:
        _restored(s, r.job_id, timeout)
    return Path(r.detail)


def _restored(s: Settings, job_id: int, timeout: float) -> None:
    """Run restore job ``job_id`` here and wait until it is done; raise if it is not."""
    from pipeline import operations

    operations.restore_here(s, job_id)  # in this process; handed to the host's worker if it fails here
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(s.db_url, readonly=True) as session:
            job = session.get(Job, job_id)
            state, error = (job.state, job.last_error) if job is not None else ("unknown", None)
        if state == states.RestoreState.DONE:
            return
        if state == states.RestoreState.FAILED:
            raise RestoreError(f"restore job {job_id} failed: {error}")
        if time.monotonic() > deadline:
            raise RestoreError(f"restore job {job_id} is still {state} after {timeout:.0f} s")
        time.sleep(0.1)


def _describe(s: Settings, ref: str | int | Path) -> Protected:
    from pipeline.detection.catalog import latest_store_job, resolve

    with session_scope(s.db_url, readonly=True) as session:
        ckpt = resolve(session, str(ref), s.host_id)
        job = latest_store_job(session, ckpt.id)
        if job is None:
            raise UnknownCheckpoint(str(ref))
        return _row(ckpt, job)


def _row(ckpt: Checkpoint, job: Job) -> Protected:
    return Protected(ckpt.id, ckpt.path, ckpt.run, ckpt.step, job.state,
                     datetime.fromtimestamp(ckpt.mtime, tz=UTC), job.id)
