"""Background priority: the tool's work on a training host yields the CPU and the disk to training
(docs/design.md, "Background priority").

Two settings say how far: ``nice`` (0-19, Linux's CPU weight: at +10 a busy process gets about a
tenth of the share of one at 0) and ``ionice`` (``best-effort:0-7``, ``idle``, or ``none``). Both
are per thread on Linux and inherited by the threads and processes started afterwards, so they
are applied first thing in a process (``ckpt up``'s children, the trainer's recorder) and hold
for everything it then runs. The I/O class acts only where the disk's I/O scheduler honours it
(BFQ; ``none`` and ``mq-deadline`` ignore it): :func:`io_effective` says which.
"""
from __future__ import annotations

import os
import platform
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ConfigError
from pipeline.liveness import stat_fields

_IOPRIO_CLASS = {"realtime": 1, "best-effort": 2, "idle": 3}
_IOPRIO_SHIFT = 13
_IOPRIO_WHO_PROCESS = 1
#: ioprio_set's and ioprio_get's numbers by machine (they have no libc wrapper).
_SYS_IOPRIO = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274), "s390x": (282, 283),
               "riscv64": (30, 31)}


@dataclass(frozen=True)
class Priority:
    """How much lower than training the tool runs: ``nice`` 0-19, ``io`` as parsed by :func:`parse_io`."""

    nice: int
    io: tuple[str, int] | None  # (class, level) or None: leave the I/O priority alone

    def __str__(self) -> str:
        io = "unchanged" if self.io is None else (self.io[0] if self.io[0] == "idle" else f"{self.io[0]}:{self.io[1]}")
        return f"nice +{self.nice}, I/O {io}"


def parse_io(text: str) -> tuple[str, int] | None:
    """``best-effort:7`` / ``idle`` / ``none`` as (class, level) or None; ConfigError otherwise."""
    value = text.strip().lower()
    if value in ("", "none"):
        return None
    if value == "idle":
        return ("idle", 0)
    cls, _, level = value.partition(":")
    if cls == "best-effort" and level.isdigit() and 0 <= int(level) <= 7:
        return (cls, int(level))
    raise ConfigError(f"ionice must be 'best-effort:N' (N 0-7, 7 the lowest), 'idle' or 'none', got {text!r}")


def of(nice: int, ionice: str) -> Priority:
    if not 0 <= nice <= 19:
        raise ConfigError(f"nice must be between 0 and 19, got {nice}")
    return Priority(nice, parse_io(ionice))


def lower(p: Priority) -> list[str]:
    """Lower the calling thread (and what it starts from now on) to ``p``; what could not be done,
    as sentences (never raises: a container without the right to renice still trains)."""
    problems: list[str] = []
    if sys.platform != "linux":
        return ["background priority is applied on Linux only"]
    if p.nice:
        try:
            current = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, max(current, p.nice))
        except OSError as exc:
            problems.append(f"nice +{p.nice}: {exc.strerror}")
    if p.io is not None:
        number = _SYS_IOPRIO.get(platform.machine(), (None, None))[0]
        if number is None:
            problems.append(f"ionice: unknown syscall number on {platform.machine()}")
        else:
            import ctypes  # here, not at import: every command imports this module (through its settings)

            cls, level = p.io
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, (_IOPRIO_CLASS[cls] << _IOPRIO_SHIFT) | level) != 0:
                problems.append(f"ionice {cls}: {os.strerror(ctypes.get_errno())}")
    return problems


def check(p: Priority) -> list[str]:
    """What :func:`lower` could not do here, found on a thread of this process that then ends
    (what a child told to lower itself before it runs cannot say)."""
    problems: list[str] = []
    t = threading.Thread(target=lambda: problems.extend(lower(p)), name="ckpt-priority-check")
    t.start()
    t.join()
    return problems


def of_process(pid: int) -> Priority:
    """The priority thread ``pid`` runs at (a process's: its main thread's), as :func:`lower` sets it."""
    nice = int(stat_fields(pid)[16])  # field 19
    number = _SYS_IOPRIO.get(platform.machine(), (None, None))[1]
    if number is None:
        return Priority(nice, None)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(number, _IOPRIO_WHO_PROCESS, pid)
    if value < 0:
        raise OSError(ctypes.get_errno(), f"ioprio_get({pid})")
    cls = {v: k for k, v in _IOPRIO_CLASS.items()}.get(value >> _IOPRIO_SHIFT)
    return Priority(nice, None if cls is None else (cls, 0 if cls == "idle" else value & 0x1FFF))


def io_effective(path: str | Path) -> bool | None:
    """Whether the disk holding ``path`` schedules by I/O class (BFQ); None when unknown."""
    try:
        dev = os.stat(path).st_dev
        block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        for d in (block, block.parent):
            sched = d / "queue" / "scheduler"
            if sched.exists():
                return "[bfq]" in sched.read_text()
    except OSError:
        return None
    return None
