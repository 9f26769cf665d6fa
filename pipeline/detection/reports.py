"""What a watcher reports as not protected, and why: each problem once (docs/design.md, section 2).

A problem is a row (status, the UI and /metrics show it) and one log line, and another line only
when it changes kind (:func:`problems.kind_of`). Faults (an error reading a run or an entry:
pipeline.detection.faults) are problems the watcher also backs off from, cleared once the path
reads again; a run or a directory where runs appear is reported as a whole when it cannot be read
or watched.
"""
from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from pipeline.db.engine import session_scope
from pipeline.detection import faults, problems
from pipeline.settings import Settings

log = logging.getLogger("ckpt.watcher")


def shown(path: str) -> str:
    """``path`` as it can be recorded and printed (a name that is not UTF-8 gets U+FFFD)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class Reports:
    """The problems one watcher reported (path -> reason), the faults among them, their backoff."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.reported: dict[str, str] = {}   # path -> last problem reported
        #: path -> the fault reported for it (an error reading it), while it is failing
        self.faults: dict[str, str] = {}
        self.backoff = faults.Backoff()      # runs and entries that failed: when to look again
        self.whole: set[str] = set()         # runs (and where runs appear) reported as a whole

    def problem(self, run: Path, path: str, reason: str, *, exc: BaseException | None = None) -> None:
        """Report once (log, and the row status, the UI and /metrics show) why ``path`` is skipped.

        Logged again only when the problem changes its kind (:func:`problems.kind_of`), not when
        a number in it does ("incomplete for 60 s" then "for 90 s"); the row keeps the latest words.
        ``exc``: an unexpected error (a bug), whose traceback the one log line carries.
        """
        before = self.reported.get(path)
        if before == reason:
            return
        self.reported[path] = reason
        if before is None or problems.kind_of(before) != problems.kind_of(reason):
            log.error("not protecting %s: %s", path, reason, exc_info=exc)
        try:
            with session_scope(self.settings.db_url) as s:
                problems.report(s, path, str(run), reason, self.settings.host_id)
        except Exception:  # the control plane may be away: the log line above stands
            log.exception("could not record the problem of %s", path)

    def clear(self, key: str) -> None:
        self.reported.pop(key, None)
        try:
            with session_scope(self.settings.db_url) as s:
                problems.clear(s, key, self.settings.host_id)
        except Exception:  # the control plane may be away: cleared again at the next start
            log.exception("could not clear the problem of %s", key)

    def failed(self, run: Path, path: str, exc: BaseException) -> float:
        """``path`` (a run or an entry) failed with ``exc``: report it once, look again later;
        the seconds until then. A path that vanished or changed while read is no fault; the
        control plane failing is no run's (the scan stops; the watcher's loop tries it again)."""
        if isinstance(exc, SQLAlchemyError):
            raise exc
        if faults.changed_while_read(exc):
            return self.settings.settle_seconds
        delay = self.backoff.failed(path)
        reason = f"{faults.describe(exc)} (looked at again in {delay:.0f} s)"
        key = shown(path)
        self.faults[key] = reason
        if key == str(run):
            self.whole.add(key)
        self.problem(run, key, reason, exc=None if isinstance(exc, OSError) else exc)
        return delay

    def recovered(self, path: str) -> None:
        """``path`` was looked at without error: the fault it had (if any) is over."""
        self.backoff.succeeded(path)
        key = shown(path)
        reason = self.faults.pop(key, None)
        if reason is not None and self.reported.get(key) == reason:
            self.clear(key)

    def unwatched(self, alive: set[str], failed: dict[str, str]) -> None:
        """Report the directories that get no file events (``failed``: path -> why); forget
        those reported as a whole that read and are watched again, or are no longer ``alive``."""
        for key in sorted(self.whole):
            if key in alive and (key in self.faults or key in failed):
                continue
            self.whole.discard(key)
            self.faults.pop(key, None)
            self.backoff.succeeded(key)
            self.clear(key)
        for key, why in failed.items():
            if key not in self.faults:  # a run that cannot be read says so; its watch is secondary
                self.whole.add(key)
                self.problem(Path(key), key, why)
