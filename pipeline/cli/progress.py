"""Waiting for a job from the command line: one progress line on a terminal, plain lines otherwise."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from pipeline import states
from pipeline.errors import CkptError
from pipeline.settings import Settings
from pipeline.units import human_bytes


def wait_job(s: Settings, job_id: int, *, ok: tuple[str, ...], timeout: float) -> int:
    from sqlalchemy import select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import Job, JobEvent

    bar = Progress(sys.stderr)
    deadline = time.monotonic() + timeout
    last_state = None
    while True:
        with session_scope(s.db_url, readonly=True) as session:
            job = session.get(Job, job_id)
            if job is None:
                raise CkptError(f"no job {job_id}")
            state, done, total, kind = job.state, job.bytes_done, job.bytes_total, job.kind
            error, blocked = job.last_error, job.blocked_reason
            said = session.scalar(select(JobEvent.detail).where(JobEvent.job_id == job_id, JobEvent.to_state == state)
                                  .order_by(JobEvent.id.desc()).limit(1)) if state in ok else None
        if state in ok:  # the last line says what the job found, once
            bar.line(f"job {job_id}: {state}" + "".join(f": {t}" for t in (said, blocked) if t))
            return 0
        if state != last_state:
            bar.line(f"job {job_id}: {state}")
            last_state = state
        bar.update(state, done, total)
        if state in states.TERMINAL[kind]:
            bar.line(f"job {job_id} ended {state}: {error or 'see `ckpt status`'}")
            return 1
        if time.monotonic() > deadline:
            bar.line(f"job {job_id}: still {state} after {timeout:.0f} s; it goes on in the background")
            return 2
        time.sleep(0.05)


def watching(state: str, every: float = 0.2) -> Callable[[int, int], None]:
    """A progress bar for work running in this process, told (from any thread) the bytes done
    and the total; drawn at most every ``every`` seconds, on a terminal only."""
    bar = Progress(sys.stderr)
    lock = threading.Lock()
    drawn = 0.0

    def watch(done: int, total: int) -> None:
        nonlocal drawn
        with lock:
            if bar.tty and time.monotonic() - drawn >= every:
                drawn = time.monotonic()
                bar.update(state, done, total)

    return watch


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


class Progress:
    """A one-line progress bar on a terminal; plain lines otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.tty = stream, stream.isatty()
        self.started = time.monotonic()

    def update(self, state: str, done: int, total: int) -> None:
        if not self.tty or not total:
            return
        frac = min(1.0, done / total)
        width = 30
        rate = done / max(1e-6, time.monotonic() - self.started)
        self.stream.write(f"\r  {state:<10} [{'#' * int(frac * width):<{width}}] {frac:6.1%} "
                          f"{human_bytes(done)}/{human_bytes(total)} {human_bytes(rate)}/s")
        self.stream.flush()

    def line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()
