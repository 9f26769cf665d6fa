"""Keeping a job's lease while one long call runs (docs/design.md, invariant 3).

A step renews its job's lease as it goes; but a single upload, re-hash or copy can take
longer than the lease on a slow link, and a lease that ends while the step is still working
makes the scheduler send the step again: duplicate uploads beside the first, until the job
runs out of attempts. :func:`leased` renews the leases from a helper thread, by time, for as
long as the block runs; if the process dies, the thread dies with it and the lease runs out
as it should.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

from sqlalchemy import and_, or_, update

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.db.transitions import now
from pipeline.settings import Settings

log = logging.getLogger("ckpt.leases")

#: A job some actor is working on (states.ACTIVE): the only leases worth extending.
_WORKING = or_(*(and_(Job.kind == kind, Job.state.in_(sorted(group))) for kind, group in states.ACTIVE.items()))


def extend(settings: Settings, job_ids: Sequence[int]) -> int:
    """Push the lease of every job of ``job_ids`` that is still being worked on to a full
    lease from now; how many were extended."""
    if not job_ids:
        return 0
    t = now()
    with session_scope(settings.db_url) as s:
        result = s.execute(update(Job).where(Job.id.in_(list(job_ids)), _WORKING)
                           .values(lease_until=t + timedelta(seconds=settings.lease_seconds))
                           .execution_options(synchronize_session=False))
        return int(getattr(result, "rowcount", 0) or 0)


@contextmanager
def leased(settings: Settings, job_ids: Sequence[int]) -> Iterator[None]:
    """Keep the leases of ``job_ids`` from running out while the block runs."""
    if not job_ids:
        yield
        return
    stop = threading.Event()
    every = max(0.2, settings.lease_seconds / 3)

    def renew() -> None:
        while not stop.wait(every):
            try:
                extend(settings, job_ids)
            except Exception as exc:  # the next beat tries again; the lease is a third gone at most
                log.warning("could not renew the lease of jobs %s: %s", list(job_ids), exc)

    beat = threading.Thread(target=renew, name="ckpt-lease", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
