"""The Dramatiq actors: thin, idempotent, taking ids (docs/design.md, invariant 3).

Each loads by id, calls its step in ``pipeline``, and sends the follow-up messages the
step returns only after the step's transactions committed.
"""
from __future__ import annotations

import logging
from typing import Any

import dramatiq

from pipeline import deliveries
from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.errors import AttemptsExhausted
from pipeline.integrity.gc import collect
from pipeline.integrity.reconcile import reconcile as reconcile_step
from pipeline.integrity.reconcile import request_reconcile
from pipeline.integrity.repair import repair as repair_step
from pipeline.integrity.scrub import scrub as scrub_step
from pipeline.restoring.job import restore as restore_step
from pipeline.steps import Send
from pipeline.store.replication import replicate as replicate_step
from pipeline.store.rotation import plan_run
from pipeline.store.rotation import rotate as rotate_step
from pipeline.store.rotation import rotate_part as rotate_part_step
from pipeline.store.sharding import shard_checkpoint
from pipeline.store.verification import recheck_shared, verify_checkpoint
from pipeline.tasks.sending import send_all

log = logging.getLogger("ckpt.tasks")

_settings = settings_mod.current()
_SECOND = 1000
_common: dict[str, Any] = dict(
    max_retries=_settings.max_retries,
    min_backoff=_settings.min_backoff_ms,
    max_backoff=_settings.max_backoff_ms,
    throws=(AttemptsExhausted,),
)
#: Long transfers get an explicit limit; control steps a short one.
_TRANSFER: dict[str, Any] = dict(_common, time_limit=int(_settings.transfer_time_limit * _SECOND))
_CONTROL: dict[str, Any] = dict(_common, time_limit=10 * 60 * _SECOND)


@dramatiq.actor(actor_name="shard", queue_name="ckpt", **_TRANSFER)
def shard(job_id: int, sent: list[int] | None = None) -> None:
    send_all(shard_checkpoint(settings_mod.current(), job_id, sent or ()))


@dramatiq.actor(actor_name="replicate", queue_name="ckpt", **_TRANSFER)
def replicate(copy_id: int, chain: list[int] | None = None, named: dict[str, Any] | None = None) -> None:
    send_all(replicate_step(settings_mod.current(), copy_id, chain or (), named, key=deliveries.CURRENT.get()))


@dramatiq.actor(actor_name="verify", queue_name="ckpt", **_TRANSFER)
def verify(job_id: int) -> None:
    send_all(verify_checkpoint(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="recheck", queue_name="ckpt", **_TRANSFER)
def recheck(job_id: int) -> None:
    send_all(recheck_shared(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="rotate_run", queue_name="ckpt", **_CONTROL)
def rotate_run(run: str) -> None:
    send_all(plan_run(settings_mod.current(), run))


@dramatiq.actor(actor_name="rotate", queue_name="ckpt", **_CONTROL)
def rotate(job_id: int) -> None:
    send_all(rotate_step(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="rotate_part", queue_name="ckpt", **_CONTROL)
def rotate_part(job_id: int, host: str) -> None:
    send_all(rotate_part_step(settings_mod.current(), job_id, host))


@dramatiq.actor(actor_name="restore", queue_name="ckpt", **_TRANSFER)
def restore(job_id: int) -> None:
    send_all(restore_step(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="scrub", queue_name="ckpt", **_TRANSFER)
def scrub(job_id: int) -> None:
    send_all(scrub_step(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="repair", queue_name="ckpt", **_TRANSFER)
def repair(job_id: int) -> None:
    send_all(repair_step(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="reconcile", queue_name="ckpt", **_TRANSFER)
def reconcile(job_id: int) -> None:
    send_all(reconcile_step(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="gc", queue_name="ckpt", **_TRANSFER)
def gc(job_id: int) -> None:
    send_all(collect(settings_mod.current(), job_id))


@dramatiq.actor(actor_name="reconcile_worker", queue_name="ckpt", **_CONTROL)
def reconcile_worker(worker_id: str) -> None:
    """Messages of the release before reconcile jobs (still queued at an upgrade) start one."""
    settings = settings_mod.current()
    with session_scope(settings.db_url) as s:
        job = request_reconcile(s, settings, worker_id, "queued before the upgrade")
        sends = [Send("reconcile", (job.id,))] if job is not None else []
    send_all(sends)
