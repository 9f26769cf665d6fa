"""Which queues a live Dramatiq worker consumes: a host whose queue has none is down.

Every Dramatiq worker process says which queues it consumes (``queue_consumers``: queue, host,
when) every ``consumer_beat_seconds`` (pipeline.tasks.middleware.ConsumerBeat). A queue whose
newest beat is older than :data:`SILENT_BEATS` beats has no live consumer: nothing is sent to it
(a message there would only wait, and a re-drive each lease would pile up beside it), and the
jobs whose next step goes there wait, visibly, for its host (docs/design.md, "Deliveries").

A queue that never had a consumer row is *unknown*, not down: a control plane whose workers
never beat (a single-process test, a release before this one) sends as it always did.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from pipeline.db.models import QueueConsumer
from pipeline.db.transitions import now
from pipeline.settings import Settings

#: A queue whose consumer missed this many beats in a row has no live consumer.
SILENT_BEATS = 3
#: What ``jobs.blocked_reason`` starts with while a job waits for its host.
WAITING = "waiting for host "


def is_waiting(reason: str | None) -> bool:
    """Whether a job's ``blocked_reason`` says it waits for its host (:meth:`Silent.reason`)."""
    return bool(reason and reason.startswith(WAITING))


@dataclass(frozen=True)
class Silent:
    """A queue with no live consumer: whose it is, and when a consumer was last seen."""

    queue: str
    host: str
    since: datetime

    def reason(self) -> str:
        return (f"{WAITING}{self.host} since {self.since:%Y-%m-%d %H:%M:%S} UTC: "
                f"no Dramatiq worker consumes its queue {self.queue}; it resumes when one does")


def beat(session: Session, host: str, queues: Iterable[str]) -> None:
    """Say that a worker of ``host`` consumes ``queues`` now."""
    t = now()
    for queue in sorted(set(queues)):
        done = session.execute(update(QueueConsumer).where(QueueConsumer.queue == queue)
                               .values(host=host, seen_at=t).execution_options(synchronize_session=False))
        if not getattr(done, "rowcount", 0):
            session.add(QueueConsumer(queue=queue, host=host, seen_at=t))


def live_since(settings: Settings) -> datetime:
    """A queue whose consumer beat before this has none alive now."""
    return now() - timedelta(seconds=SILENT_BEATS * settings.consumer_beat_seconds)


def silent(session: Session, settings: Settings, queues: Iterable[str]) -> dict[str, Silent]:
    """Of ``queues``, those that had a consumer and have none alive now."""
    wanted = sorted(set(queues))
    if not wanted:
        return {}
    cutoff = live_since(settings)
    rows = session.execute(select(QueueConsumer.queue, QueueConsumer.host, QueueConsumer.seen_at)
                           .where(QueueConsumer.queue.in_(wanted), QueueConsumer.seen_at < cutoff)).all()
    return {q: Silent(q, host, seen) for q, host, seen in rows}


def live(session: Session, settings: Settings) -> list[str]:
    """The queues a live consumer serves now."""
    cutoff = live_since(settings)
    return list(session.scalars(select(QueueConsumer.queue).where(QueueConsumer.seen_at >= cutoff)
                                .order_by(QueueConsumer.queue)))
