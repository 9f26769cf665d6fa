"""File events that wake the watcher: inotify watches on the runs and where runs appear.

Events only make detection faster: the periodic scan finds everything they would. So a watch
that cannot be added (the inotify watch limit, a directory gone meanwhile) costs speed, not
protection: it is reported against its path (pipeline.detection.faults) and tried again with
backoff, and the other watches are added as usual.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

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

from pipeline.detection import faults

log = logging.getLogger("ckpt.watcher")

#: Events that can change what a run holds. Not opens and closes without a write: the
#: watcher opens every checkpoint it looks at, and its own reads woke it up again at once,
#: in a loop that kept one core busy for as long as a checkpoint was in a run.
CHANGES = [FileCreatedEvent, FileDeletedEvent, FileModifiedEvent, FileMovedEvent, FileClosedEvent,
           DirCreatedEvent, DirDeletedEvent, DirModifiedEvent, DirMovedEvent]


class _RunChanged(FileSystemEventHandler):
    def __init__(self, poke: Callable[[Path], None], run: Path) -> None:
        self.poke, self.run = poke, run

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.poke(self.run)  # only CHANGES arrive: the observer filters (event_filter)


class _NewRun(FileSystemEventHandler):
    """A directory appeared where a root's glob finds runs: a new run, looked at now (not at
    the next full scan), so its first checkpoint is detected as fast as the others."""

    def __init__(self, new_run: Callable[[], None]) -> None:
        self.new_run = new_run

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.new_run()


class Watches:
    """The watches added so far, and those that failed (path -> why), tried again with backoff."""

    def __init__(self, poke: Callable[[Path], None], new_run: Callable[[], None], *,
                 backoff: faults.Backoff | None = None) -> None:
        self.poke, self.new_run = poke, new_run
        self.observer = Observer()
        self.watched: set[Path] = set()
        self.failed: dict[str, str] = {}
        self.backoff = backoff or faults.Backoff()

    def start(self) -> None:
        self.observer.start()

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=5)

    def cover(self, parents: list[Path], runs: list[Path]) -> None:
        """Watch each of ``parents`` for new runs and each of ``runs`` (recursively) for changes."""
        for parent in parents:
            self._add(parent, _NewRun(self.new_run), recursive=False, event_filter=[DirCreatedEvent, DirMovedEvent])
        for run in runs:
            self._add(run, _RunChanged(self.poke, run), recursive=True, event_filter=CHANGES)

    def _add(self, path: Path, handler: FileSystemEventHandler, *, recursive: bool,
             event_filter: list[type[FileSystemEvent]]) -> None:
        key = str(path)
        if path in self.watched or self.backoff.wait(key) is not None:
            return
        try:
            self.observer.schedule(handler, key, recursive=recursive, event_filter=event_filter)
        except OSError as exc:  # the watch limit, a directory gone: events lost, the scan goes on
            self.backoff.failed(key)
            self.failed[key] = faults.describe(exc)
            return
        self.watched.add(path)
        self.backoff.succeeded(key)
        self.failed.pop(key, None)

    def forget(self, keep: set[str]) -> list[str]:
        """Drop the failures of paths not in ``keep`` (no longer runs); the paths dropped."""
        gone = [key for key in self.failed if key not in keep]
        for key in gone:
            self.failed.pop(key)
            self.backoff.succeeded(key)
        return gone
