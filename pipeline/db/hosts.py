"""Training hosts as they report in (docs/design.md, "Hosts").

A host's watcher reports in every few seconds (``last_seen``), and so does each Dramatiq worker
process consuming its queue ``ckpt.host.<id>``; both write the host's hostname as its ``label``.
Whether something consumes the host's queue now is the queue's beat (pipeline/consumers.py,
``queue_consumers``: one heartbeat for both uses): a restore is routed only to a host whose
queue has a live consumer, and nothing else is sent to one that has none.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline import consumers
from pipeline.db.models import QueueConsumer, TrainingHost
from pipeline.db.transitions import now
from pipeline.errors import NoConsumer
from pipeline.hostid import host_queue
from pipeline.settings import Settings

log = logging.getLogger("ckpt.hosts")

#: Two reports under one id from different hostnames within this long: two machines share it.
SHARED_ID_SECONDS = 30.0


@dataclass(frozen=True)
class Host:
    """A training host as the UI and the API show it."""

    id: str
    label: str | None
    last_seen: datetime
    consumer_seen: datetime | None
    consumer_live: bool


def report_in(session: Session, host: str, label: str, *, consumer: bool = False) -> None:
    """Record that ``host`` (called ``label`` now) is alive; ``consumer``: and that something
    consumes its queue now (the beat a Dramatiq worker process there sends)."""
    t = now()
    row = session.get(TrainingHost, host)
    if row is None:
        row = TrainingHost(name=host, last_seen=t)
        session.add(row)
    elif row.label not in (None, label) and t - row.last_seen < timedelta(seconds=SHARED_ID_SECONDS):
        log.warning("host %s reports from hostname %s seconds after %s did: if both machines run, they share one "
                    "host id (a copied home); give each its own (remove the copy's host-id file, or set CKPT_HOST)",
                    host, label, row.label)
    row.last_seen, row.label = t, label
    if consumer:
        consumers.beat(session, host, [host_queue(host)])


def consumer_seen(session: Session, host: str) -> datetime | None:
    """When a Dramatiq worker process last said it consumes ``host``'s queue (None: never)."""
    row = session.get(QueueConsumer, host_queue(host))
    return row.seen_at if row is not None else None


def listed(session: Session, settings: Settings) -> list[Host]:
    """Every host that ever reported in, those with a live consumer first, then by id."""
    cutoff = consumers.live_since(session, settings)
    hosts = []
    for r in session.scalars(select(TrainingHost)):
        seen = consumer_seen(session, r.name)
        hosts.append(Host(r.name, r.label, r.last_seen, seen, seen is not None and seen >= cutoff))
    return sorted(hosts, key=lambda h: (not h.consumer_live, h.id))


def with_consumer(session: Session, settings: Settings) -> list[Host]:
    """The hosts a restore may be sent to now: their queue has a live consumer."""
    return [h for h in listed(session, settings) if h.consumer_live]


def require_consumer(session: Session, settings: Settings, host: str) -> None:
    """Raise :class:`NoConsumer` unless a Dramatiq process consumes ``host``'s queue now."""
    seen = consumer_seen(session, host)
    if seen is not None and seen >= consumers.live_since(session, settings):
        return
    raise NoConsumer(host, seen, [h.id for h in with_consumer(session, settings)])
