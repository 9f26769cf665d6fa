"""The Dramatiq broker of this process, set before any actor is declared.

Redis is disposable transport (docs/design.md, section 1): heartbeats and maintenance are tuned
so a killed worker's messages come back within a minute, and the scheduler's lease
re-drive is the real guarantee. ``CKPT_REDIS_URL=stub://`` gives a StubBroker for fast
unit tests.
"""
from __future__ import annotations

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import Retries

from pipeline import failpoints
from pipeline.settings import Settings
from pipeline.tasks.middleware import ConsumerBeat, Failpoints, JobFailures, Ready

#: A worker whose heartbeat is older than this is presumed dead (ms).
HEARTBEAT_TIMEOUT_MS = 15_000
#: Maintenance (requeueing dead workers' messages) runs on this many commands per million.
MAINTENANCE_CHANCE = 20_000


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
    if settings.ready_dir:
        broker.add_middleware(Ready())
    if not isinstance(broker, StubBroker):  # unit tests' in-process workers have no host to speak for
        broker.add_middleware(ConsumerBeat())
    if failpoints.ENABLED:
        broker.add_middleware(Failpoints())
    return broker


def install(settings: Settings) -> dramatiq.Broker:
    broker = build_broker(settings)
    dramatiq.set_broker(broker)
    return broker
