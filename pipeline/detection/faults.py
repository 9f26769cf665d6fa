"""Errors under a run: what the watcher says about them, and when it looks again.

Any error while detecting under a run (a run directory or a file the watcher may not read, a
disk answering EIO, the inotify watch limit) belongs to that run or entry: it is reported once
(pipeline.detection.problems) and the run or entry is looked at again after a delay that
doubles at each failure, from :data:`FIRST_SECONDS` up to :data:`MOST_SECONDS`; the other runs
go on. A path whose own metadata changes (a ``chmod``, a new file in it) is looked at again at
once. An entry that vanishes or changes while it is read is no error: it is looked at again
when it settles, as any entry being written.
"""
from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.errors import SourceChanged

#: First delay before a failed run or entry is looked at again; it doubles at each failure.
FIRST_SECONDS = 5.0
#: Longest delay between two looks at a run or entry that keeps failing.
MOST_SECONDS = 300.0

#: What a path's metadata was when it failed: a different one (a chmod, a change inside it)
#: makes it due at once. None when the path cannot even be stat'ed.
Stamp = tuple[int, int, int] | None


def stamp(path: str) -> Stamp:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_mode, st.st_mtime_ns, st.st_ctime_ns)


def gone(path: str) -> bool:
    """Whether nothing is at ``path`` (not: whether it can be seen). A file in a directory the
    watcher may not search is not gone: ``os.path.lexists`` says False for both."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def changed_while_read(exc: BaseException) -> bool:
    """True for the errors of an entry that vanished or changed while it was read (looked at
    again once it settles), as opposed to one that cannot be read (a fault, reported)."""
    if isinstance(exc, SourceChanged | FileNotFoundError | NotADirectoryError):
        return True
    # pipeline.hashing raises a bare OSError (no errno) when a file's size moved under it
    return type(exc) is OSError and exc.errno is None


def describe(exc: BaseException) -> str:
    """A problem's words for ``exc``, with what to do where the error says it."""
    if isinstance(exc, PermissionError):
        who = f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "its user"
        return (f"cannot read it: permission denied ({exc.filename or exc}): the watcher runs as {who};"
                " give it read and search (x) access to protect it")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and "inotify" in str(exc):
        return ("file events cannot be watched: the inotify watch limit is reached (raise"
                " fs.inotify.max_user_watches); its checkpoints are still found by the periodic scan")
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"cannot read it: {exc.strerror or os.strerror(exc.errno)} ({exc.filename or exc})"
    return f"detection failed: {type(exc).__name__}: {exc}"


@dataclass
class _Failed:
    delay: float
    due: float
    stamp: Stamp


class Backoff:
    """Paths whose last look failed, and when each is due again.

    ``clock`` is injectable so tests step time instead of sleeping."""

    def __init__(self, *, first: float = FIRST_SECONDS, most: float = MOST_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first, self.most, self.clock = first, most, clock
        self._failed: dict[str, _Failed] = {}

    def failed(self, path: str) -> float:
        """``path`` failed now: the seconds until it is due again (doubling at each failure)."""
        before = self._failed.get(path)
        delay = self.first if before is None else min(self.most, before.delay * 2)
        self._failed[path] = _Failed(delay, self.clock() + delay, stamp(path))
        return delay

    def wait(self, path: str) -> float | None:
        """Seconds until ``path`` is due again; None when it is due (or never failed)."""
        f = self._failed.get(path)
        if f is None:
            return None
        left = f.due - self.clock()
        if left <= 0 or stamp(path) != f.stamp:
            return None
        return left

    def succeeded(self, path: str) -> bool:
        """``path`` was looked at without error; True when it had failed before."""
        return self._failed.pop(path, None) is not None

    def __contains__(self, path: str) -> bool:
        return path in self._failed
