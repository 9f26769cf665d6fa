"""Checkpoints declared complete by a trainer, recorded in the background (docs/design.md,
"Explicit completion").

``pipeline.protect(path)`` hands the path to this process's protector and returns: the
trainer's thread never hashes a checkpoint and never waits on the control plane. One daemon
thread per process takes the declarations in the order they were made and has each recorded
as ``ckpt store PATH`` does (``operations.store``: hash while sending early, record, send) by
the trainer's recorder, a child process at the background CPU and I/O priority
(pipeline/recorder.py, pipeline/priority.py); the thread itself only waits for its answers.

A failure never reaches the trainer. It is logged once per run and cause (not once per save),
counted in the home's ledger (pipeline.degraded: "protection degraded since T" in status, the
UI and ``/metrics``), and the next save of the run that is recorded clears it; the watcher
stays the safety net. At exit, what is still queued gets up to ``DRAIN_SECONDS``.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import degraded
from pipeline import home as home_mod
from pipeline import settings as settings_mod
from pipeline.errors import CkptError, IncompleteCheckpoint, NotProtectedYet, OutsideRoots
from pipeline.masking import masked_url
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.api import Protected

log = logging.getLogger("ckpt.integrations")

#: How much lower than the trainer the recording thread runs (Linux: nice is per thread).
NICE = 10
#: At interpreter exit, how long declarations still queued may delay it.
DRAIN_SECONDS = 60.0


class NoHome(CkptError):
    """Raised when a trainer protects a checkpoint and no ckpt home can be found."""


def settings_here() -> Settings:
    """The settings of the home found the way every ``ckpt`` command finds it (pipeline/home.py),
    loaded now (a ``ckpt up`` started since publishes its roots); :class:`NoHome` if none is."""
    found = home_mod.find(None, os.environ)
    if not found.exists and not os.environ.get("CKPT_DATABASE_URL"):
        if found.how == "env":
            raise NoHome(found.missing())
        raise NoHome("no ckpt home found: looked for " + "; ".join(found.looked) + ". Set CKPT_HOME to the home "
                     "of the `ckpt up` that watches this run (or train below the directory that holds its .ckpt)")
    return settings_mod.load({"home": str(found.path)})


def explain(exc: BaseException, s: Settings | None) -> str:
    """What went wrong, pointing the right way (never "roots: (none configured)" when the
    trouble is that no ``ckpt up`` is running or no home was found)."""
    names = {f"{c.__module__}.{c.__name__}" for c in type(exc).__mro__}
    if s is not None and any(n.startswith(("redis.", "dramatiq.")) and "Connection" in n for n in names):
        return (f"the broker of home {s.home} ({masked_url(s.broker_url)}) does not answer: is `ckpt up` running? "
                f"({type(exc).__name__}: {exc}). A save recorded before this is stored once it is back")
    if s is not None and "sqlalchemy.exc.OperationalError" in names:
        return f"the control plane's database ({masked_url(s.db_url)}) cannot be used: {str(exc).splitlines()[0]}"
    if isinstance(exc, OutsideRoots) and s is not None:
        if not (s.home / "up.json").exists() and not s.roots:
            return (f"no `ckpt up` is running for home {s.home}, so no root is watched; start it with "
                    f"`ckpt up --home {s.home} --root RUNS` (RUNS: this run directory, or its parent with /*)")
        shown = ", ".join(s.roots) or "(none)"
        return (f"{exc.path} is not a checkpoint in a run under a watched root of home {s.home} (roots: {shown}); "
                "add its run directory (or its parent with /*) as a root: `ckpt up --root ...`")
    if isinstance(exc, IncompleteCheckpoint) and "does not exist" in exc.reason:
        return (f"{exc.path} was deleted before it was recorded (the trainer's own rotation? "
                "wait_before_delete=True makes it wait)")
    return str(exc) if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}"


def run_of(path: str | Path) -> str:
    """The run a declared path belongs to, as the ledger names it: its directory."""
    return os.path.dirname(os.path.abspath(path))


class Declared:
    """A checkpoint declared complete, recorded in the background: :meth:`result` waits for
    the record (and raises what stopped it)."""

    def __init__(self, path: str, settings: Settings | None) -> None:
        self.path, self.settings = path, settings
        self._future: Future[Protected] = Future()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Protected:
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise NotProtectedYet(f"{self.path} is still being recorded after {timeout:.0f} s") from None

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


def _at_exit(fn: Callable[[], object]) -> None:
    """Run ``fn`` when the interpreter exits, before thread pools refuse new work: recording
    uses them (hashing, the broker), and ``concurrent.futures`` shuts them down in the
    threading module's exit hooks, which run (newest first) before ``atexit``'s."""
    import concurrent.futures.thread  # noqa: F401  (its hook registered first, so it runs after ours)

    register = getattr(threading, "_register_atexit", None)
    (register or atexit.register)(fn)


class Protector:
    """The recording thread of this process and what it has said (once per run and cause)."""

    def __init__(self, record: Callable[[str, Settings], Protected], *, nice: int = NICE,
                 drain_seconds: float = DRAIN_SECONDS) -> None:
        self.record, self.nice, self.drain_seconds = record, nice, drain_seconds
        self._queue: queue.Queue[Declared] = queue.Queue()
        self._lock = threading.Lock()
        self._latest: dict[str, Declared] = {}  # path -> its newest declaration
        self._said: dict[str, str] = {}  # run -> the kind of failure last logged
        self._thread: threading.Thread | None = None

    def declare(self, path: str | Path, settings: Settings | None = None) -> Declared:
        """Queue ``path`` to be recorded; returns at once."""
        d = Declared(os.path.abspath(path), settings)
        with self._lock:
            self._latest[d.path] = d
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-protect", daemon=True)
                self._thread.start()
                _at_exit(self.drain)
        self._queue.put(d)
        return d

    def latest(self, path: str | Path) -> Declared | None:
        """The newest declaration of ``path`` in this process, if any."""
        with self._lock:
            return self._latest.get(os.path.abspath(path))

    def failing(self, run: str) -> bool:
        """Whether the newest attempt to protect a save of ``run`` failed here."""
        with self._lock:
            return run in self._said

    def drain(self, timeout: float | None = None) -> int:
        """Wait (up to ``timeout``, default ``drain_seconds``) for what is queued; how many are left."""
        deadline = time.monotonic() + (self.drain_seconds if timeout is None else timeout)
        while True:
            with self._lock:
                left = [d for d in self._latest.values() if not d.done()]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if left and timeout is None:
            log.warning("ckpt: exiting with %d declared checkpoint(s) not recorded yet (%s); the watcher protects "
                        "them once it finds them complete", len(left), ", ".join(d.path for d in left[:3]))
        return len(left)

    def failed(self, run: str, exc: BaseException, s: Settings | None) -> None:
        """Count a failure to protect ``run``: logged once per kind of cause, noted in the ledger."""
        try:
            cause = explain(exc, s)
        except Exception:  # explaining must not stop the thread either
            cause = repr(exc)
        kind = getattr(exc, "kind", type(exc).__name__)  # a recorder's failure names its own kind
        with self._lock:
            new = self._said.get(run) != kind
            self._said[run] = kind
        if new:
            log.warning("ckpt: protection of %s degraded: %s. Training goes on (said once; `ckpt status` "
                        "counts the failures); a running watcher still protects what it finds complete", run, cause)
        else:
            log.debug("ckpt: %s still degraded: %s", run, cause)
        if s is not None:
            try:
                degraded.note(s.home, run, cause)
            except OSError as err:
                log.debug("ckpt: could not note %s as degraded in %s: %s", run, s.home, err)

    def _recorded(self, run: str, s: Settings) -> None:
        with self._lock:
            was = self._said.pop(run, None)
        try:
            old = degraded.clear(s.home, run)
        except OSError:
            old = None
        if was is not None or old is not None:
            log.warning("ckpt: protection of %s works again%s", run,
                        f" ({old.failures} failure(s) since {old.since:%Y-%m-%d %H:%M:%S} UTC)" if old else "")

    def _run(self) -> None:
        if sys.platform == "linux" and self.nice:
            try:  # Linux keeps a nice value per thread; the threads this one starts inherit it
                me = threading.get_native_id()  # never above the trainer (root may raise it)
                os.setpriority(os.PRIO_PROCESS, me, max(os.getpriority(os.PRIO_PROCESS, me), self.nice))
            except OSError:
                pass
        while True:
            d = self._queue.get()
            if self.latest(d.path) is not d:  # declared again since: the newer declaration records it
                d._future.set_exception(CkptError(f"{d.path} was declared again before it was recorded"))
                continue
            s: Settings | None = d.settings
            try:
                s = s or settings_here()
                protected = self.record(d.path, s)
            except Exception as exc:  # nothing may stop the thread or reach the trainer
                if self.latest(d.path) is d:  # not a save superseded meanwhile by a newer one
                    self.failed(run_of(d.path), exc, s)
                d._future.set_exception(exc)  # after the ledger: who waited sees the run degraded
                continue
            self._recorded(run_of(d.path), s)
            d._future.set_result(protected)
