"""Messages that only say "look again": at most one waits per queue and arguments.

``rotate_run``, ``rotate`` and ``rotate_part`` have no row of their own to key their message on
(pipeline/deliveries.py keys job steps and copies); each is idempotent (it looks at the run or
checkpoint and acts on what it finds). Every repair that finishes and every scheduler sweep
asks for one, so while the host's consumer is busy (a slow link, a long upload) they used to
pile up in its queue: the chaos soak found 97 queued for 6 outstanding job steps. Now a message
of such an actor is sent only if none for the same arguments waits in that queue; the marker is
dropped when a worker starts on the message (:func:`release`), so a request made while it runs
is sent again and not lost, and it expires after ``ttl_ms`` in case its message was lost.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import dramatiq
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers import redis as dramatiq_redis
from dramatiq.brokers.stub import StubBroker

COLLAPSED = frozenset({"rotate_run", "rotate", "rotate_part"})


def _marker(broker: dramatiq_redis.RedisBroker, queue: str, actor: str, args: Sequence[Any]) -> str:
    digest = hashlib.sha256(json.dumps([actor, list(args)], sort_keys=True, default=str).encode()).hexdigest()
    return f"{broker.namespace}:ckpt.waiting.{queue}.{digest[:32]}"


def claim(broker: dramatiq.Broker, queue: str, actor: str, args: Sequence[Any], ttl_ms: int) -> bool:
    """Whether a message of ``actor(*args)`` may be enqueued on ``queue`` now (always, for an
    actor not in :data:`COLLAPSED`); if so, it counts as waiting there from now on."""
    if actor not in COLLAPSED:
        return True
    if isinstance(broker, dramatiq_redis.RedisBroker):
        return bool(broker.client.set(_marker(broker, queue, actor, args), b"1", nx=True, px=ttl_ms))
    if isinstance(broker, StubBroker) and queue in broker.queues:
        return not any(m.actor_name == actor and list(m.args) == list(args)
                       for m in (Message.decode(body) for body in list(broker.queues[queue].queue)))
    return True


def release(broker: dramatiq.Broker, message: Message[Any] | MessageProxy) -> None:
    """A worker starts on ``message``: it no longer waits, and the next request is sent."""
    if message.actor_name in COLLAPSED and isinstance(broker, dramatiq_redis.RedisBroker):
        broker.client.delete(_marker(broker, message.queue_name, message.actor_name, message.args))
