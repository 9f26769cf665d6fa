"""Named failpoints: places in the code where a fault-injection test can crash or break it.

Off (the default, and always in production) unless the environment variable
``CKPT_FAILPOINTS`` names a directory when this module is imported: then :func:`hit`
is a test of one module global, nothing more. When on, ``hit(name)`` looks for the file
``<dir>/<name>`` and does what its first line says:

    kill            SIGKILL this process, right here (a crash at exactly this point)
    stop            SIGSTOP this process (a hung process; the test sends SIGCONT)
    raise           raise :class:`FailpointError`
    enospc          raise ``OSError(ENOSPC)`` (a full disk)
    sleep <s>       pause ``s`` seconds

A trigger fires once: the first process to reach it claims it by renaming the file to
``<name>.fired`` (atomic, so two racing processes never both fire), and writes its pid
there. Prefix the action with ``always`` (``always enospc``) for a fault that lasts until
the test removes the file; each time it acts, a line is appended to ``<name>.hits``.

Commit points are named after the Dramatiq actor whose message is being processed and
the ordinal of the commit within that message: ``replicate.commit2.before`` fires just
before the second transaction of a ``replicate`` message commits, ``.after`` just after
it committed (before the side effects that follow it). With ``<dir>/trace`` present,
every failpoint reached is appended to it, one ``name pid module:line`` per line: that is
how the fault harness learns which points an operation passes through.

A commit point can also be armed by its place in the code, whatever its ordinal:
``gc@gc.py:212.before`` fires at the first commit made at ``gc.py:212`` by a ``gc``
message. The ordinal of the commit after a loop depends on how many rounds the loop ran
(how much work that message found); its place does not.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from types import FrameType

ENV = "CKPT_FAILPOINTS"
_DIR: str = os.environ.get(ENV) or ""
ENABLED = bool(_DIR)
_local = threading.local()


class FailpointError(RuntimeError):
    """The fault a ``raise`` failpoint injects."""


def hit(name: str) -> None:
    """Act on the failpoint ``name`` if a test armed it; nothing at all otherwise."""
    if not ENABLED:
        return
    _act(name)


def begin_message(actor: str) -> None:
    """Name the commit points of this thread after ``actor`` until :func:`end_message`."""
    if ENABLED:
        _local.actor, _local.commits = actor, 0


def end_message() -> None:
    if ENABLED:
        _local.actor = None


def clock_offset() -> float:
    """Seconds to add to this process's wall clock: 0, unless a test skewed it.

    ``<dir>/clock.<pid>`` holds the offset for process ``pid`` (a clock jumped forward two
    days is ``172800``, back one hour ``-3600``). Every timestamp the control plane writes or
    compares (:func:`pipeline.db.transitions.now`) and every request signature goes through it.
    """
    if not ENABLED:
        return 0.0
    try:
        with open(os.path.join(_DIR, f"clock.{os.getpid()}")) as f:
            return float(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0.0


def commit_point(when: str) -> None:
    """``before`` or ``after`` a transaction commits, inside an actor's message."""
    if not ENABLED:
        return
    actor = getattr(_local, "actor", None)
    if actor is None:
        return
    if when == "before":
        _local.commits += 1
    place = _caller()
    _act(f"{actor}.commit{_local.commits}.{when}", place, f"{actor}@{place}.{when}")


def _act(name: str, place: str | None = None, alias: str | None = None) -> None:
    trace = os.path.join(_DIR, "trace")
    if os.path.exists(trace):
        with open(trace, "a") as f:
            f.write(f"{name} {os.getpid()} {place or _caller()}\n")
    for armed in (name, alias):
        if armed is None:
            continue
        path = os.path.join(_DIR, armed)
        try:
            with open(path) as f:
                words = f.read().split()
        except FileNotFoundError:
            continue
        name = armed
        break
    else:
        return
    if not words:
        return
    if words[0] == "always":
        words = words[1:]
        with open(path + ".hits", "a") as f:
            f.write(f"pid {os.getpid()} at {time.time():.3f}\n")
    else:
        try:
            os.rename(path, path + ".fired")  # claim it: exactly one process fires a trigger
        except FileNotFoundError:
            return  # another process claimed it first
        with open(path + ".fired", "a") as f:
            f.write(f"pid {os.getpid()} at {time.time():.3f}\n")
    action, arg = words[0], words[1:]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # the signal is delivered before this returns
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "raise":
        raise FailpointError(f"failpoint {name}")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")
    elif action == "sleep":
        time.sleep(float(arg[0]) if arg else 1.0)
    else:
        raise ValueError(f"failpoint {name}: unknown action {action!r}")


def _caller() -> str:
    """``module:line`` of the code that reached the failpoint (outside this plumbing)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and os.path.basename(frame.f_code.co_filename) in _PLUMBING:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_PLUMBING = {"failpoints.py", "engine.py", "contextlib.py"}
