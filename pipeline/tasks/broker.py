"""The Dramatiq broker of this process, set before any actor is declared.

Redis is disposable transport (docs/design.md, section 1): heartbeats and maintenance are tuned
so a killed worker's messages come back within a minute, and the scheduler's lease
re-drive is the real guarantee. ``CKPT_REDIS_URL=stub://`` gives a StubBroker for fast
unit tests.
"""
from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq import Message
from dramatiq.brokers import redis as dramatiq_redis
from dramatiq.brokers.stub import StubBroker
from dramatiq.common import current_millis
from dramatiq.middleware import Retries

from pipeline import failpoints
from pipeline.settings import Settings
from pipeline.tasks.middleware import CodecWarmth, ConsumerBeat, Deliveries, Failpoints, JobFailures, Ready

#: A worker whose heartbeat is older than this is presumed dead (ms).
HEARTBEAT_TIMEOUT_MS = 15_000
#: Maintenance (requeueing dead workers' messages) runs on this many commands per million.
MAINTENANCE_CHANCE = 20_000


class RedisBroker(dramatiq_redis.RedisBroker):
    """Dramatiq's Redis broker, enqueueing a message under its own message id.

    Dramatiq files each message in Redis under a fresh random id; here a message enqueued
    without a delay is filed under its message id, so whether a message sent for a step is
    still queued (or being worked on) is one ``HEXISTS`` (:func:`queued`,
    pipeline/deliveries.py). A retry's delayed copy keeps Dramatiq's random id while it waits
    (the original is acked under its own id after the copy is enqueued), and is filed under the
    message id again once it is due.
    """

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        if delay is not None:
            return super().enqueue(message, delay=delay)
        message = message.copy(options={"redis_message_id": message.message_id})
        self.emit_before("enqueue", message, delay)
        self.do_enqueue(message.queue_name, message.message_id, message.encode())
        self.emit_after("enqueue", message, delay)
        return message


def queued(broker: dramatiq.Broker, queue: str, message_id: str, silent_ms: int | None = None) -> bool:
    """Whether message ``message_id`` is in ``queue``, waiting or being worked on by a live
    worker. One held by a worker silent for ``silent_ms`` (default: the broker's heartbeat
    timeout) is not: a step is re-driven only once its lease ended, which a delivery at work
    renews, and Dramatiq gives a dead worker's messages back only at a maintenance pass, which
    can be minutes away; so the re-drive sends a new message, and the old one, if it comes
    back, is stale and dropped (pipeline/deliveries.py)."""
    if isinstance(broker, dramatiq_redis.RedisBroker):
        client, ns = broker.client, broker.namespace
        if not client.hexists(f"{ns}:{queue}.msgs", message_id):
            return False
        silent = min(broker.heartbeat_timeout, silent_ms if silent_ms is not None else broker.heartbeat_timeout)
        dead = client.zrangebyscore(f"{ns}:__heartbeats__", 0, current_millis() - silent)
        return not any(client.sismember(f"{ns}:__acks__.{w.decode() if isinstance(w, bytes) else w}.{queue}",
                                        message_id) for w in dead)
    if isinstance(broker, StubBroker) and queue in broker.queues:
        return any(Message.decode(body).message_id == message_id for body in list(broker.queues[queue].queue))
    return False


def build_broker(settings: Settings) -> dramatiq.Broker:
    if settings.broker_url.startswith("stub://"):
        broker: dramatiq.Broker = StubBroker()
        broker.emit_after("process_boot")
    else:
        broker = RedisBroker(
            url=settings.broker_url,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_MS,
            maintenance_chance=MAINTENANCE_CHANCE,
        )
    for mw in broker.middleware:
        if isinstance(mw, Retries):
            mw.max_retries = settings.max_retries
            mw.min_backoff = settings.min_backoff_ms
            mw.max_backoff = settings.max_backoff_ms
    # emit_after runs middleware in reverse: placed before Retries, JobFailures sees
    # the message after Retries decided whether it failed for good.
    broker.add_middleware(JobFailures(), before=Retries)
    broker.add_middleware(Deliveries())
    if settings.ready_dir:
        broker.add_middleware(Ready())
    if not isinstance(broker, StubBroker):  # unit tests' in-process workers have no host to speak for
        broker.add_middleware(CodecWarmth())
        broker.add_middleware(ConsumerBeat())
    if failpoints.ENABLED:
        broker.add_middleware(Failpoints())
    return broker


def install(settings: Settings) -> dramatiq.Broker:
    broker = build_broker(settings)
    dramatiq.set_broker(broker)
    return broker
