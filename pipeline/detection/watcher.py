"""The watcher: turns checkpoints that appear under the roots into ``detected`` jobs.

watchdog reports file events so a run is rescanned at once; a periodic scan catches what
events miss (network filesystems, a watcher started late). At start, the disk is
reconciled with the database: new checkpoints are detected, and checkpoints whose local
copy vanished are marked so.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select
from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from pipeline import failpoints
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.detection import catalog, completeness, roots
from pipeline.errors import HeaderError, IncompleteCheckpoint, SourceChanged
from pipeline.settings import Settings
from pipeline.steps import Send
from pipeline.store import trash

log = logging.getLogger("ckpt.watcher")

#: An incomplete checkpoint is reported after it stayed incomplete this many settle windows.
REPORT_AFTER_SETTLES = 10

#: Events that can change what a run holds. Not opens and closes without a write: the
#: watcher opens every checkpoint it looks at, and its own reads woke it up again at once,
#: in a loop that kept one core busy for as long as a checkpoint was in a run.
CHANGES = [FileCreatedEvent, FileDeletedEvent, FileModifiedEvent, FileMovedEvent, FileClosedEvent,
           DirCreatedEvent, DirDeletedEvent, DirModifiedEvent, DirMovedEvent]


class _Events(FileSystemEventHandler):
    def __init__(self, watcher: Watcher, run: Path) -> None:
        self.watcher, self.run = watcher, run

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.watcher.poke(self.run)  # only CHANGES arrive: the observer filters (event_filter)


class Watcher:
    def __init__(self, settings: Settings, send: Callable[[list[Send]], None], *, use_events: bool = True) -> None:
        self.settings, self.send, self.use_events = settings, send, use_events
        self.known: dict[str, tuple] = {}       # path -> signature already recorded
        self.first_incomplete: dict[str, float] = {}
        self.reported: dict[str, str] = {}      # path -> last problem logged
        self.dirty: set[Path] = set()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.observer = Observer() if use_events else None
        self.watched: set[Path] = set()

    # -- events ------------------------------------------------------------------------

    def poke(self, run: Path) -> None:
        self.dirty.add(run)
        self.wake.set()

    def _watch_new_runs(self, runs: list[Path]) -> None:
        if self.observer is None:
            return
        for run in runs:
            if run not in self.watched:
                self.observer.schedule(_Events(self, run), str(run), recursive=True, event_filter=CHANGES)
                self.watched.add(run)

    # -- reconciliation ----------------------------------------------------------------

    def reconcile(self) -> None:
        """Startup sweep: remember what is recorded; mark vanished local copies."""
        with session_scope(self.settings.db_url) as s:
            # Locked (PostgreSQL): a rotation deciding right now commits first, then is seen.
            for ckpt in s.scalars(select(Checkpoint).where(Checkpoint.local_present.is_(True)).with_for_update()):
                if not os.path.lexists(ckpt.path) and not trash.put_back(ckpt.path):
                    catalog.mark_vanished(s, ckpt)
                    log.warning("local copy of checkpoint %d vanished: %s", ckpt.id, ckpt.path)
                    continue
                self.known[ckpt.path] = tuple((f.relpath, f.size, f.mtime_ns) for f in ckpt.files)

    def scan(self, only: set[Path] | None = None) -> float:
        """Scan runs (all, or ``only``); returns seconds until something needs a new look."""
        runs = roots.runs(self.settings.roots)
        self._watch_new_runs(runs)
        next_look = self.settings.scan_interval
        for run in runs:
            if only is not None and run not in only:
                continue
            present = set()
            for path in roots.checkpoints_in(run):
                present.add(str(path))
                wait = self.consider(run, path)
                if wait is not None:
                    next_look = min(next_look, wait)
            self._vanished(run, present)
        return next_look

    def _vanished(self, run: Path, present: set[str]) -> None:
        gone = [p for p in self.known if os.path.dirname(p) == str(run) and p not in present]
        if not gone:
            return
        with session_scope(self.settings.db_url) as s:
            for path in gone:
                self.known.pop(path, None)
                for ckpt in s.scalars(select(Checkpoint).where(Checkpoint.path == path,
                                                               Checkpoint.local_present.is_(True))
                                      .with_for_update()):
                    if trash.put_back(path):  # a rotation crashed before it committed
                        log.warning("%s was in the trash of a rotation that did not commit; put back", path)
                        continue
                    catalog.mark_vanished(s, ckpt)
                    log.warning("local copy of checkpoint %d vanished: %s", ckpt.id, path)

    def consider(self, run: Path, path: Path) -> float | None:
        """Detect ``path`` if it is complete and settled; seconds to wait if it may be soon."""
        key = str(path)
        try:
            entries = completeness.inspect(path)
        except (IncompleteCheckpoint, HeaderError) as exc:
            first = self.first_incomplete.setdefault(key, time.time())
            # A malformed file may still be being written: report once it had time to settle.
            if time.time() - first >= self.settings.settle_seconds * REPORT_AFTER_SETTLES:
                self._report(key, str(exc))
            return self.settings.settle_seconds
        except OSError:
            return self.settings.settle_seconds  # vanished or changed while looking
        sig = catalog.signature(entries)
        if self.known.get(key) == sig:
            return None
        tree_ns = completeness.tree_mtime_ns(path)
        if not completeness.settled(entries, self.settings.settle_seconds, tree_ns=tree_ns):
            newest = max(max(e.mtime_ns for e in entries), tree_ns) / 1e9
            return max(0.05, self.settings.settle_seconds - (time.time() - newest))
        try:
            detected = catalog.hash_checkpoint(run, path, entries, shard_size=self.settings.shard_size)
        except (SourceChanged, OSError):
            return self.settings.settle_seconds
        if completeness.tree_mtime_ns(path) != tree_ns:  # an entry came or went while hashing
            return self.settings.settle_seconds
        with session_scope(self.settings.db_url) as s:
            ckpt, job, created = catalog.record(s, detected, lease_seconds=self.settings.lease_seconds,
                                                detail="detected by the watcher")
            job_id = job.id if job is not None else None
        self.known[key] = sig
        self.first_incomplete.pop(key, None)
        self.reported.pop(key, None)
        if created and job_id is not None:
            log.info("detected %s as checkpoint %d (job %d)", path, ckpt.id, job_id)
            failpoints.hit("watch.recorded")  # committed, not yet enqueued
            self.send([Send("shard", (job_id,))])
        return None

    def _report(self, key: str, problem: str) -> None:
        if self.reported.get(key) != problem:
            self.reported[key] = problem
            log.error("not protecting %s", problem)

    # -- loop --------------------------------------------------------------------------

    def run(self) -> None:
        self.reconcile()
        if self.observer is not None:
            self.observer.start()
        try:
            wait = self.scan()
            deadline = time.monotonic() + self.settings.scan_interval
            while not self.stopping.is_set():
                self.wake.wait(timeout=max(0.01, wait))
                self.wake.clear()
                if self.stopping.is_set():
                    break
                if time.monotonic() >= deadline:
                    wait = self.scan()
                    deadline = time.monotonic() + self.settings.scan_interval
                else:
                    dirty, self.dirty = self.dirty, set()
                    wait = self.scan(only=dirty) if dirty else self.scan()
        finally:
            if self.observer is not None:
                self.observer.stop()
                self.observer.join(timeout=5)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
