"""Worker function of the transition-latency measurement (importable by spawned processes)."""
from __future__ import annotations

import time


def run(args: tuple[str, int]) -> list[float]:
    """Create ``n`` store jobs, then time every transition of their main line."""
    from pipeline.db.engine import session_scope
    from pipeline.db.transitions import create_job, transition

    url, n = args
    with session_scope(url) as s:
        ids = [create_job(s, "store", checkpoint_id=None).id for _ in range(n)]
    lat = []
    for job_id in ids:
        for a, b in (("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")):
            t = time.perf_counter()
            with session_scope(url) as s:
                transition(s, job_id, "store", a, b)
            lat.append(time.perf_counter() - t)
    return lat
