"""The dead-letter queue: list and requeue the messages Dramatiq gave up on.

Dramatiq keeps them in the Redis sorted set ``dramatiq:<queue>.XQ`` with bodies in the
hash ``dramatiq:<queue>.XQ.msgs`` and has no API for them. Requeueing
sends a fresh message without the old retry count, puts the job back in the state it
failed from, and removes the dead letter.
"""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import dramatiq
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, Job
from pipeline.db.transitions import now, transition
from pipeline.errors import CkptError
from pipeline.settings import Settings
from pipeline.states import CopyState, JobKind
from pipeline.tasks.failures import job_ids_for

QUEUE = "ckpt"


def _broker() -> RedisBroker:
    broker = dramatiq.get_broker()
    if not isinstance(broker, RedisBroker):
        raise CkptError(f"dead letters are kept by a Redis broker; this process has {type(broker).__name__}")
    return broker


def _keys(broker: RedisBroker) -> tuple[str, str]:
    xq = f"{broker.namespace}:{QUEUE}.XQ"
    return xq, f"{xq}.msgs"


def list_letters(settings: Settings) -> list[dict[str, Any]]:
    broker = _broker()
    xq, msgs = _keys(broker)
    out = []
    # With withscores and raw (bytes) responses, redis-py answers [(member, score), ...].
    entries = cast("list[tuple[bytes, float]]", broker.client.zrange(xq, 0, -1, withscores=True))
    for raw_id, score in entries:
        mid = raw_id.decode()
        body = broker.client.hget(msgs, mid)
        if not isinstance(body, bytes):
            continue
        m = Message.decode(body)
        tb = m.options.get("traceback") or ""
        out.append({
            "id": mid, "message_id": m.message_id, "actor": m.actor_name, "args": list(m.args),
            "kwargs": m.kwargs, "retries": m.options.get("retries", 0),
            "failed_at": datetime.fromtimestamp(score / 1000.0, tz=UTC),
            "error": tb.strip().splitlines()[-1] if tb.strip() else None, "traceback": tb,
        })
    return out


def requeue(settings: Settings, ids: list[str] | None = None) -> int:
    """Requeue the named dead letters (all when ``ids`` is None); returns how many."""
    broker = _broker()
    xq, msgs = _keys(broker)
    wanted = None if ids is None else set(ids)
    n = 0
    for letter in list_letters(settings):
        if wanted is not None and letter["id"] not in wanted and letter["message_id"] not in wanted:
            continue
        _revive_job(settings, letter["actor"], tuple(letter["args"]))
        # Under its own message id: the key its step recorded (pipeline/deliveries.py), so the
        # revived message is its step's message, not a stale delivery.
        fresh: Message[Any] = Message(queue_name=QUEUE, actor_name=letter["actor"], args=tuple(letter["args"]),
                                      kwargs=letter["kwargs"] or {}, options={}, message_id=letter["message_id"])
        broker.enqueue(fresh)
        broker.client.zrem(xq, letter["id"])
        broker.client.hdel(msgs, letter["id"])
        n += 1
    return n


def _revive_job(settings: Settings, actor: str, args: tuple[Any, ...]) -> None:
    with session_scope(settings.db_url) as s:
        if actor == "replicate":
            cp = s.get(ContentCopy, int(args[0]))
            if cp is not None and cp.state == CopyState.PENDING:
                cp.attempts = 0
        for job_id in job_ids_for(s, actor, args, failed=True):
            job = s.get(Job, job_id)
            if job is None:  # the job was deleted: the fresh message will find nothing to do
                continue
            back = (job.params or {}).get("failed_from") if job.kind == JobKind.STORE else "queued"
            if job.state == states.StoreState.FAILED and back:
                transition(s, job_id, job.kind, job.state, back, detail="requeued from the dead-letter queue",
                           lease_until=now() + timedelta(seconds=settings.lease_seconds), last_error=None)


def summary(settings: Settings) -> tuple[int, datetime | None]:
    """How many dead letters there are, and when the oldest of them failed (None: none)."""
    broker = _broker()
    xq, _msgs = _keys(broker)
    n = int(cast("int", broker.client.zcard(xq)))
    first = cast("list[tuple[bytes, float]]", broker.client.zrange(xq, 0, 0, withscores=True))
    return n, datetime.fromtimestamp(first[0][1] / 1000.0, tz=UTC) if first else None
