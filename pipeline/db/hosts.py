"""Training hosts as they report in (docs/design.md, "Hosts").

A host's watcher reports in every few seconds (``last_seen``); each Dramatiq worker process
consuming its queue ``ckpt.host.<id>`` says it runs every :data:`CONSUMER_BEAT_SECONDS`
(``consumer_seen``). Both write the host's hostname as its ``label``. A restore is routed only
to a host with a live consumer: one seen within :data:`CONSUMER_LIVE_SECONDS`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.db.models import TrainingHost
from pipeline.db.transitions import now
from pipeline.errors import NoConsumer

log = logging.getLogger("ckpt.hosts")

#: How often a Dramatiq worker process says that it consumes its host's queue.
CONSUMER_BEAT_SECONDS = 10.0
#: A consumer not heard from for this long (three beats) is gone: stopped, killed or cut off.
CONSUMER_LIVE_SECONDS = 3 * CONSUMER_BEAT_SECONDS


@dataclass(frozen=True)
class Host:
    """A training host as the UI and the API show it."""

    id: str
    label: str | None
    last_seen: datetime
    consumer_seen: datetime | None
    consumer_live: bool


def report_in(session: Session, host: str, label: str, *, consumer: bool = False) -> None:
    """Record that ``host`` (called ``label`` now) is alive; ``consumer``: a Dramatiq worker
    process consuming its queue says so."""
    t = now()
    row = session.get(TrainingHost, host)
    if row is None:
        row = TrainingHost(name=host, last_seen=t)
        session.add(row)
    elif row.label not in (None, label) and t - row.last_seen < timedelta(seconds=CONSUMER_LIVE_SECONDS):
        log.warning("host %s reports from hostname %s seconds after %s did: if both machines run, they share one "
                    "host id (a copied home); give each its own (remove the copy's host-id file, or set CKPT_HOST)",
                    host, label, row.label)
    row.last_seen, row.label = t, label
    if consumer:
        row.consumer_seen = t


def _live(seen: datetime | None, t: datetime) -> bool:
    return seen is not None and t - seen <= timedelta(seconds=CONSUMER_LIVE_SECONDS)


def listed(session: Session) -> list[Host]:
    """Every host that ever reported in, those with a live consumer first, then by id."""
    t = now()
    hosts = [Host(r.name, r.label, r.last_seen, r.consumer_seen, _live(r.consumer_seen, t))
             for r in session.scalars(select(TrainingHost))]
    return sorted(hosts, key=lambda h: (not h.consumer_live, h.id))


def with_consumer(session: Session) -> list[Host]:
    """The hosts a restore may be sent to now: their queue has a live consumer."""
    return [h for h in listed(session) if h.consumer_live]


def require_consumer(session: Session, host: str) -> None:
    """Raise :class:`NoConsumer` unless a Dramatiq process consumes ``host``'s queue now."""
    row = session.get(TrainingHost, host)
    seen = row.consumer_seen if row is not None else None
    if _live(seen, now()):
        return
    live = [h.id for h in with_consumer(session)]
    raise NoConsumer(host, seen, live)
