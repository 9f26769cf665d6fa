"""What a person can ask for (store, restore, scrub, collect, forget, pin), shared by the CLI
and the web UI.

Each validates, records the job in one transaction, and only then enqueues (commit, then act).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import inspect
from sqlalchemy.orm import Session

from pipeline import states
from pipeline.db import copies, hosts, workers
from pipeline.db.content_rf import run_rf
from pipeline.db.engine import get_engine, session_scope
from pipeline.db.models import StorageWorker
from pipeline.db.transitions import now
from pipeline.detection import catalog, completeness, roots
from pipeline.errors import CkptError, IncompleteCheckpoint, RestoreError
from pipeline.integrity import gc, retention, scrub
from pipeline.objectstore import tier
from pipeline.restoring import destination
from pipeline.restoring import job as restore_job
from pipeline.settings import Settings
from pipeline.steps import Send, record_error
from pipeline.store.early import EarlySends
from pipeline.units import human_bytes

log = logging.getLogger("ckpt.operations")


@dataclass(frozen=True)
class Requested:
    job_id: int
    checkpoint_id: int | None
    created: bool
    state: str
    detail: str
    #: False: recorded, but the broker did not answer (`ckpt up` is down or restarting); the
    #: scheduler sends its message once its lease ends and the broker answers again.
    sent: bool = True


def _send(sends: list[Send]) -> bool:
    """Send what a request decided, after it committed. A broker that does not answer (Redis
    down while `ckpt up` restarts) loses nothing: the job is recorded, and the scheduler re-drives
    it once its lease ends (docs/design.md, invariant 3); the caller is told, not failed. The
    broker's modules are imported here: a restore run in this process never sends anything."""
    import dramatiq.errors
    import redis.exceptions

    from pipeline.tasks.actors import send_all

    try:
        send_all(sends)
        return True
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, dramatiq.errors.ConnectionError,
            OSError) as exc:
        log.warning("the job is recorded, but its message could not be sent now (%s: %s); the scheduler "
                    "sends it again when its lease ends, once the broker answers", type(exc).__name__, exc)
        return False


def store(settings: Settings, path: str, *, detail: str = "requested") -> Requested:
    """Protect the checkpoint at ``path`` (inside a watched root) now: complete by declaration.

    The person or program asking says the writer is done, so neither the layout's markers
    nor the quiet period are waited for; a file that is broken by its own structure (a
    truncated safetensors file, a zip without its end record) is still refused.
    """
    run, ckpt_path = roots.locate(path, settings.roots)
    options = settings.options_for(roots.root_of(run, settings.roots))
    if not ckpt_path.exists():
        raise IncompleteCheckpoint(str(ckpt_path), "it does not exist")
    found = completeness.examine(ckpt_path, commit_marker=options.commit_marker,
                                 follow_link=ckpt_path.is_symlink())  # locate() kept it inside its root
    entries = completeness.accept(found, declared=True)
    started = now()
    with EarlySends(settings, _send, options.replication, rf=settings.rf_for(str(run)),
                    total_bytes=completeness.total_size(entries)) as early:
        detected = catalog.hash_checkpoint(run, ckpt_path, entries, shard_size=settings.shard_size,
                                           layout=found.verdict.layout,
                                           completed_by="structure" if found.verdict.complete else "declared",
                                           on_shard=early.on_shard)
    with session_scope(settings.db_url) as s:
        ckpt, job, created = catalog.record(s, detected, lease_seconds=settings.lease_seconds, detail=detail,
                                            host=settings.host_id, started_at=started)
        result = Requested(job.id, ckpt.id, created, job.state, str(ckpt_path))
    if created:
        result = dataclasses.replace(result, sent=_send([Send("shard", (result.job_id, early.sent))]))
    return result


def restore_to(settings: Settings, ref: str | int, dest: str, *, overwrite: bool = False,
               from_here: bool = False, host: str | None = None, send: bool = True) -> Requested:
    """Give checkpoint ``ref`` (id or path) back at ``dest`` on ``host`` (default this one), which
    must have a running consumer (:class:`pipeline.errors.NoConsumer`). ``from_here``: the caller
    runs on this host (the CLI, the Python API), so its current directory is a restore root too.
    ``send=False``: the job is only recorded, for the caller to run here (:func:`restore_here`)."""
    with session_scope(settings.db_url) as s:
        job = restore_job.request(s, settings, ref, dest, overwrite=overwrite, host=host,
                                  extra_roots=[Path.cwd()] if from_here else [])
        result = Requested(job.id, job.checkpoint_id, True, job.state, job.params["dest"])
    if not send:
        return result
    return dataclasses.replace(result, sent=_send([Send("restore", (result.job_id,))]))


def check_restores(settings: Settings, wanted: Sequence[tuple[str | int, str]], *, overwrite: bool = False,
                   from_here: bool = False, host: str | None = None) -> None:
    """Check, before any is recorded, the restores of checkpoints that go back together (the
    files of one save, each a checkpoint: ``wanted`` is (ref, dest), every dest in one folder),
    so that a refusal leaves no part of the save restored or on its way. The folder is created
    on this host if it does not exist yet (its parent must), as a folder checkpoint's is. The
    caller then records and runs them one at a time (:func:`restore_to`), in ``wanted``'s order."""
    here = (host or settings.host_id) == settings.host_id
    extra = [Path.cwd().resolve()] if from_here and here else []
    folders = {os.path.dirname(dest) for _ref, dest in wanted}
    if len(folders) != 1:
        raise ValueError(f"the files of one save go back into one folder, not {sorted(folders)}")
    folder = folders.pop()
    with session_scope(settings.db_url, readonly=True) as s:
        if here:
            if os.path.lexists(folder) and not os.path.isdir(folder):
                raise RestoreError(f"{folder} is a file: the {len(wanted)} files of this save go back into a "
                                   "folder; name a folder")
            target = Path(folder).expanduser().resolve()
            destination.check(s, settings, target, extra)
            if not target.parent.is_dir():
                raise RestoreError(f"{target.parent} is not a directory; create it first")
            made = not target.exists()
            target.mkdir(exist_ok=True)
        try:
            for ref, dest in wanted:
                if here:
                    restore_job.validate(s, settings, ref, dest, overwrite=overwrite, extra_roots=extra)
                else:
                    restore_job.validate_elsewhere(s, ref, dest, host or settings.host_id)
        except BaseException:
            if here and made:  # a refusal leaves nothing behind, not even the folder
                target.rmdir()
            raise


def restore_here(settings: Settings, job_id: int, watch: restore_job.Watch | None = None) -> bool:
    """Run restore job ``job_id`` (recorded by :func:`restore_to` with ``send=False``, for this
    host) in this process: what a caller that waits for it does (``ckpt restore --wait``,
    ``pipeline.restore()``), instead of sending its message and polling the database until the
    host's Dramatiq worker, which looks for messages at most ``CKPT_POLL_MS`` apart, has done it.
    Its attempt is counted, its lease kept and its checks made as in the actor (it is the same
    step). An attempt that fails or is interrupted here hands the job to the host's Dramatiq
    worker (its message; the attempts left and the retries go on there); a process killed outright
    leaves it to the scheduler's re-drive once its lease ends. True if it ended here."""
    try:
        follow = restore_job.restore(settings, job_id, watch)
    except BaseException as exc:
        with session_scope(settings.db_url) as s:
            record_error(s, job_id, f"restore: {type(exc).__name__}: {exc}")
        _send([Send("restore", (job_id,))])
        if not isinstance(exc, Exception):
            raise
        log.warning("restore job %d: the attempt in this process failed (%s: %s); the host's Dramatiq worker "
                    "takes it over", job_id, type(exc).__name__, exc)
        return False
    if follow:
        _send(follow)
    return True


def drain(settings: Settings, worker_id: str) -> None:
    """Copy ``worker_id``'s shards to other workers, then mark it removable (the scheduler does both)."""
    with session_scope(settings.db_url) as s:
        w = known_worker(s, worker_id)
        if workers.may(w, states.WorkerState.DRAINING):  # draining already, or drained: nothing changes
            workers.set_state(s, w, states.WorkerState.DRAINING)


def known_worker(s: Session, worker_id: str) -> StorageWorker:
    """The storage worker ``worker_id``, or an error that says where the ids are."""
    w = s.get(StorageWorker, worker_id)
    if w is None:
        raise CkptError(f"no worker {worker_id}; `ckpt workers` lists them")
    return w


@dataclass(frozen=True)
class DrainProgress:
    """Where a drain is: the worker's state, the contents it holds, and how many of them (and
    their bytes) still need its copy (fewer than RF good copies elsewhere)."""

    state: str
    held: int
    left: int
    left_bytes: int


def drain_progress(settings: Settings, worker_id: str) -> DrainProgress:
    with session_scope(settings.db_url, readonly=True) as s:
        w = known_worker(s, worker_id)
        held, left, size = copies.short_without(s, worker_id, run_rf(s, settings))
        return DrainProgress(w.state, held, left, size)


def undrain(settings: Settings, worker_id: str) -> str:
    """Cancel a drain (or a finished one): the worker goes back to ``down`` and rejoins at its next
    good probe like any worker that returns (reconciled, then its copies count). Its earlier state."""
    with session_scope(settings.db_url) as s:
        w = known_worker(s, worker_id)
        was = w.state
        if was not in states.STICKY_WORKERS:
            raise CkptError(f"storage worker {worker_id} is {was}, not draining: nothing to undrain")
        workers.set_state(s, w, states.WorkerState.DOWN, operator=True,
                          error="undrained: rejoins at its next good probe, once reconciled")
        return was


@dataclass(frozen=True)
class Removal:
    worker_id: str
    url: str
    state: str
    copies: int
    #: Contents with fewer than RF good copies without it (the repair sweep copies them).
    short: int


def remove(settings: Settings, worker_id: str, *, answers: Callable[[str, str], bool]) -> Removal:
    """Forget a storage worker. Refused while it holds the only copy of any live content (drain it
    first), or while it still answers at its URL (``answers(url, worker_id)``): the next probe or
    discovery would find it again, as a new worker holding files nobody knows of."""
    with session_scope(settings.db_url, readonly=True) as s:
        w = known_worker(s, worker_id)
        url, state = w.url, w.state
        _held, only, only_bytes = copies.short_without(s, worker_id, 1)
    if only:
        how = (f"bring it back up, then drain it: `ckpt workers drain {worker_id} --wait`" if state not in
               states.READABLE_WORKERS else f"drain it first: `ckpt workers drain {worker_id} --wait`")
        raise CkptError(f"storage worker {worker_id} ({state}) holds the only good copy of {only} content(s) "
                        f"({human_bytes(only_bytes)}): removing it would lose them; {how}, then remove it")
    if answers(url, worker_id):
        raise CkptError(f"storage worker {worker_id} still answers at {url}: stop it first (and take its URL out "
                        "of CKPT_WORKERS), else the next probe finds it again; then remove it")
    with session_scope(settings.db_url) as s:
        w = known_worker(s, worker_id)
        _held, short, _size = copies.short_without(s, worker_id, run_rf(s, settings))
        _held, only, _size = copies.short_without(s, worker_id, 1)
        if only:  # a copy elsewhere went bad meanwhile
            raise CkptError(f"storage worker {worker_id} now holds the only good copy of {only} content(s); "
                            f"drain it first: `ckpt workers drain {worker_id} --wait`")
        n = workers.remove(s, w)
    return Removal(worker_id, url, state, n, short)


def check_target_removal(settings: Settings, name: str) -> None:
    """Raise why object-store target ``name`` may not be removed from the configuration: a run's
    policy needs more targets than would remain (``target_mode = "required"``, or more
    ``target_copies`` than targets), or it holds the only good copy of a live content (any
    tier counts). There is no ``--force``: what it alone holds would be lost."""
    left = [t for t in settings.object_targets() if t.name != name]
    tables = [("the global policy (target_copies, target_mode)", {}),
              *[(f'[runs."{glob}"]', over) for glob, over in json.loads(settings.run_options or "{}").items()]]
    for where, over in tables:
        n = int(over.get("target_copies", settings.target_copies))
        mode = str(over.get("target_mode", settings.target_mode))
        if n > len(left) and (mode == "required" or n > max(len(left), 1)):
            raise CkptError(f"{where} wants {n} object-store copies (target_mode = {mode}): without target {name} "
                            f"{len(left)} target(s) remain; lower its target_copies or set target_mode = \"lag\" "
                            "first, then remove it")
    wid = tier.row_id(name)
    if not inspect(get_engine(settings.db_url, readonly=True)).has_table(StorageWorker.__tablename__):
        return  # no control plane yet: nothing recorded anywhere
    with session_scope(settings.db_url, readonly=True) as s:
        w = s.get(StorageWorker, wid)
        if w is None:
            return  # never recorded: it holds nothing
        state = w.state
        _held, only, only_bytes = copies.short_without(s, wid, 1, tier=None)
    if only:
        raise CkptError(f"target {name} ({state}) holds the only good copy of {only} content(s) "
                        f"({human_bytes(only_bytes)}): removing it would lose them; wait until the storage workers "
                        "hold them again (the repair sweep copies them; `ckpt status` shows replicas), then remove it")


def check_restore(settings: Settings, ref: str | int, dest: str, *, overwrite: bool = False,
                  host: str | None = None) -> Path:
    """Where a restore of ``ref`` to ``dest`` on ``host`` would write; raises why it may not,
    creates nothing. Another host's disk is checked there, when the restore runs."""
    host = host or settings.host_id
    with session_scope(settings.db_url, readonly=True) as s:
        if host != settings.host_id:
            target = restore_job.validate_elsewhere(s, ref, dest, host)[1]
        else:
            target = restore_job.validate(s, settings, ref, dest, overwrite=overwrite)[1]
        hosts.require_consumer(s, settings, host)
        return target


def scrub_now(settings: Settings, worker_ids: list[str] | None = None, *, reason: str = "requested") -> list[Requested]:
    """One scrub job per live storage worker (or the named ones)."""
    with session_scope(settings.db_url) as s:
        jobs = scrub.request_scrub(s, settings, worker_ids=worker_ids, reason=reason)
        out = [Requested(j.id, None, True, j.state, j.params["worker_id"]) for j in jobs]
    _send([Send("scrub", (r.job_id,)) for r in out])
    return out


@dataclass(frozen=True)
class Collection:
    """A garbage collection asked for: its jobs, what it condemned now, and per worker what
    it frees (or, for a dry run, would free)."""

    jobs: list[Requested]
    condemned: int
    condemned_bytes: int
    freed: list[gc.Freed]


def collect_garbage(settings: Settings, worker_ids: list[str] | None = None, *, dry_run: bool = False,
                    reason: str = "requested") -> Collection:
    """Mark unreferenced content and start one collection job per worker holding some."""
    with session_scope(settings.db_url) as s:
        freed = [f for f in gc.preview(s, settings) if not worker_ids or f.worker_id in worker_ids]
    if dry_run:
        return Collection([], 0, 0, freed)
    n, size = gc.mark(settings)
    with session_scope(settings.db_url) as s:
        jobs = gc.request_gc(s, settings, worker_ids=worker_ids, reason=reason)
        out = [Requested(j.id, None, True, j.state, j.params["worker_id"]) for j in jobs]
    _send(gc.send_for_ids([r.job_id for r in out]))
    return Collection(out, n, size, freed)


def forget(settings: Settings, refs: list[str], *, dry_run: bool = False) -> list[retention.Verdict]:
    with session_scope(settings.db_url) as s:
        return retention.forget(s, refs, dry_run=dry_run)


def pin(settings: Settings, ref: str, note: str | None = None, *, pinned: bool = True) -> tuple[int, str]:
    with session_scope(settings.db_url) as s:
        c = retention.pin(s, ref, note, pinned=pinned)
        return c.id, c.path
