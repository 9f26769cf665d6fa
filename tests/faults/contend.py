"""A contender for the SQLite control plane, run as its own process by the fault tests.

``python -m tests.faults.contend DB_URL SECONDS hold``: holds the write lock (BEGIN
IMMEDIATE) for 2 s at a time, 0.2 s apart. ``... churn``: creates jobs and moves them
through their states as fast as it can. Prints how many transactions it committed.
"""
from __future__ import annotations

import sys
import time

from sqlalchemy import text

from pipeline.db.engine import get_engine, session_scope
from pipeline.db.transitions import create_job, transition


def main(url: str, seconds: float, mode: str) -> int:
    deadline = time.monotonic() + seconds
    done = 0
    while time.monotonic() < deadline:
        if mode == "hold":
            with get_engine(url).begin() as conn:  # BEGIN IMMEDIATE: every other writer waits
                conn.execute(text("UPDATE locks SET holder = holder WHERE 1 = 0"))
                time.sleep(2.0)
            time.sleep(0.2)
        else:
            with session_scope(url) as s:
                job = create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "contender"},
                                 lease_seconds=60, detail="contention test")
                job_id = job.id
            with session_scope(url) as s:
                transition(s, job_id, "scrub", "queued", "scrubbing", lease_seconds=60)
            with session_scope(url) as s:
                transition(s, job_id, "scrub", "scrubbing", "done", detail="contention test")
        done += 1
    print(done)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[3]))
