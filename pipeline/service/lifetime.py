"""Processes die with their parents (``PR_SET_PDEATHSIG``).

Every child of ``ckpt up`` gets SIGTERM when ``ckpt up`` dies, however it dies. A Dramatiq
worker process gets SIGKILL when its master dies: the master is the OOM killer's usual pick,
and its orphaned workers otherwise keep consuming from the broker for ever, beside the
workers of the master started next (they ignore the first SIGTERM while a message runs). A
step killed midway is safe: its lease expires and the scheduler sends it again
(docs/design.md, invariant 3).
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def bind_dramatiq_worker_to_master() -> None:
    """In a Dramatiq worker process: die (SIGKILL) with the master, and now if it is gone already."""
    parent = multiprocessing.parent_process()
    if parent is None or "dramatiq.cli" not in sys.modules:
        return
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent.pid:  # the master died before the request took effect
        os._exit(1)
