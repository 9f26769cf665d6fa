"""At most one outstanding message per job step (docs/design.md, "Deliveries").

Delivery is at least once, and the scheduler re-drives every step whose lease expired. A
message of a step it re-drives is *keyed*: its Dramatiq message id (``<actor>.<uuid>``) is
recorded on the row it works for before it is enqueued (``jobs.sent_key`` for a job's step;
``copies.sent_key`` for a ``replicate``, on the copy and on every copy of its chain), only if
the row still holds the key read when the message was decided on (:func:`record`). Then:

- a delivery whose key is not its row's (another message was sent for the step since) is
  *stale*: it is dropped before it does any work or counts an attempt (:func:`is_current`);
- a new message for a step is not sent while the row's key names a message of the same actor
  that is still in its queue or being worked on (:func:`outstanding`): a re-drive is a no-op.

A row with no key (recorded before keys were, or never sent) accepts any delivery.
"""
from __future__ import annotations

import contextvars
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from pipeline.db.engine import rowcount
from pipeline.db.models import ContentCopy, Job
from pipeline.steps import Send

#: Actors whose first argument is the job whose step they run, and that the scheduler re-drives.
KEYED_JOBS = frozenset({"shard", "verify", "restore", "scrub", "repair", "reconcile", "gc"})
#: Every keyed actor: those, and ``replicate`` (keyed on its copies).
KEYED = KEYED_JOBS | {"replicate"}

#: The key of the message this thread is working on (set by the Deliveries middleware): a step
#: may send its own step's message again, and its own key is never "outstanding".
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("ckpt_delivery", default=None)


def new_key(actor: str) -> str:
    """A fresh message id for ``actor``; the actor is its prefix, so a key names its step."""
    return f"{actor}.{uuid.uuid4().hex}"


def copy_ids(args: Sequence[Any]) -> list[int]:
    """The copies a ``replicate`` message sends: its own, then its chain's."""
    chain = args[1] if len(args) > 1 and args[1] else []
    return [int(args[0]), *(int(c) for c in chain)]


def row_key(session: Session, send: Send) -> str | None:
    """The key recorded on the row ``send`` works for (None: none, or not a keyed actor)."""
    if send.actor in KEYED_JOBS:
        return session.scalar(select(Job.sent_key).where(Job.id == int(send.args[0])))
    if send.actor == "replicate":
        return session.scalar(select(ContentCopy.sent_key).where(ContentCopy.id == int(send.args[0])))
    return None


def record(session: Session, send: Send, key: str, at: datetime, *, read: str | None) -> bool:
    """Record ``key`` as the one message of ``send``'s step (before it is enqueued), if its row
    still holds ``read``, the key :func:`row_key` read when the message was decided on; False if
    another message was recorded for the step since (in this batch, or by another scheduler or
    step): that one is the step's, and this one must not be sent."""
    if send.actor in KEYED_JOBS:
        return bool(rowcount(session.execute(
            update(Job).where(Job.id == int(send.args[0]), Job.sent_key.is_not_distinct_from(read))
            .values(sent_key=key, sent_at=at).execution_options(synchronize_session=False))))
    if send.actor == "replicate":
        own, *chain = copy_ids(send.args)
        if not rowcount(session.execute(
                update(ContentCopy).where(ContentCopy.id == own, ContentCopy.sent_key.is_not_distinct_from(read))
                .values(sent_key=key, sent_at=at).execution_options(synchronize_session=False))):
            return False
        if chain:
            session.execute(update(ContentCopy).where(ContentCopy.id.in_(chain))
                            .values(sent_key=key, sent_at=at).execution_options(synchronize_session=False))
        return True
    return True


def outstanding(send: Send, key: str | None, queued: Callable[[str], bool]) -> bool:
    """Whether the row's ``key`` names another message of ``send``'s step still in its queue
    (``queued`` asks the broker): then sending again would only add a duplicate."""
    if key is None or key == CURRENT.get() or not key.startswith(send.actor + "."):
        return False
    return queued(key)


def is_current(session: Session, actor: str, args: Sequence[Any], key: str) -> bool:
    """Whether a delivery of ``actor(*args)`` with message id ``key`` is its step's message."""
    recorded = row_key(session, Send(actor, tuple(args)))
    return recorded is None or recorded == key


def still_keyed(rows: Sequence[ContentCopy], key: str | None) -> list[ContentCopy]:
    """Of a chain's copies, those this delivery still sends (a copy sent since on its own is
    that message's to send)."""
    return [c for c in rows if key is None or c.sent_key is None or c.sent_key == key]
