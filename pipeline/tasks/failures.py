"""Mapping a failed actor message to the jobs it was working for."""
from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy
from pipeline.settings import Settings
from pipeline.states import StoreState
from pipeline.steps import fail_job, record_error
from pipeline.store.replication import waiting_jobs

#: Actors whose first argument is the id of the job they run.
JOB_ACTORS = frozenset({"shard", "verify", "rotate", "rotate_part", "restore", "scrub", "repair", "reconcile", "gc"})


def job_ids_for(session: Session, actor: str, args: tuple[Any, ...], *, failed: bool = False) -> list[int]:
    """The jobs a message works for: its job, or for a copy every store waiting on its content
    (with ``failed``, every store that failed while waiting on it)."""
    if not args:
        return []
    if actor == "replicate":
        cp = session.get(ContentCopy, int(args[0]))
        if cp is None:
            return []
        if failed:
            return [job.id for job in waiting_jobs(session, cp.sha256, StoreState.FAILED)
                    if (job.params or {}).get("failed_from") == StoreState.SHARDED]
        return [job.id for job in waiting_jobs(session, cp.sha256)]
    if actor in JOB_ACTORS:
        return [int(args[0])]
    return []


def record_failure(settings: Settings, actor: str, args: tuple[Any, ...], exc: BaseException, *, final: bool) -> None:
    error = f"{type(exc).__name__}: {exc}"
    with session_scope(settings.db_url) as s:
        for job_id in job_ids_for(s, actor, args):
            record_error(s, job_id, f"{actor}: {error}")
            if final:
                fail_job(s, job_id, f"{actor}: {error}")
