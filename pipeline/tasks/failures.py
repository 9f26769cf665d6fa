"""Mapping a failed actor message to the job it was working for."""
from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from pipeline.db.engine import session_scope
from pipeline.settings import Settings
from pipeline.steps import fail_job, record_error
from pipeline.store.replication import job_of_replica


def job_id_for(session: Session, actor: str, args: tuple[Any, ...]) -> int | None:
    if not args:
        return None
    if actor == "replicate":
        job = job_of_replica(session, int(args[0]))
        return job.id if job else None
    if actor in ("shard", "verify", "rotate", "restore", "scrub", "repair"):
        return int(args[0])
    return None


def record_failure(settings: Settings, actor: str, args: tuple[Any, ...], exc: BaseException, *, final: bool) -> None:
    error = f"{type(exc).__name__}: {exc}"
    with session_scope(settings.db_url) as s:
        job_id = job_id_for(s, actor, args)
        if job_id is None:
            return
        record_error(s, job_id, f"{actor}: {error}")
        if final:
            fail_job(s, job_id, f"{actor}: {error}")
