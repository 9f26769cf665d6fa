"""Sending the messages a step returns: routed, keyed, never piled up (docs/design.md, "Deliveries").

Every message leaves through :func:`send_all`, after the deciding transaction committed. A
batch's repeats are dropped first (:func:`distinct`); then for each message, in order:

1. route it (pipeline/queues.py);
2. a queue whose consumer went silent (pipeline/consumers.py: its host is down) gets nothing;
   the jobs the message works for show ``waiting for host H since T`` (``jobs.waiting_for``,
   ``blocked_reason``) and the scheduler sends it once the host's consumer beats again;
3. a keyed step (pipeline/deliveries.py) whose message is still in its queue gets no second one;
4. otherwise a fresh key is recorded on its row, if the row still holds the key read in step 3
   (compare-and-set: else another sender keyed the step meanwhile, and this message is not sent),
   then the message is enqueued under that key, and the jobs it works for stop waiting;
5. an unkeyed "look again" message (rotation: pipeline/tasks/waiting.py) is enqueued only if
   none for the same arguments waits in that queue.
"""
from __future__ import annotations

import functools
import json
import logging
from typing import Any

import dramatiq
from dramatiq.brokers.stub import StubBroker
from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from pipeline import consumers, deliveries
from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.db.transitions import note, now
from pipeline.queues import queues_for
from pipeline.steps import Send
from pipeline.tasks.broker import queued
from pipeline.tasks.failures import job_ids_for
from pipeline.tasks.waiting import claim as claim_waiting

log = logging.getLogger("ckpt.tasks")


def send_all(sends: list[Send]) -> None:
    """Enqueue ``sends``, each on the queue of the host whose files it touches (queues.py),
    at most one message per keyed step, none to a host that is down."""
    sends = distinct(sends)
    if not sends:
        return
    broker = dramatiq.get_broker()
    settings = settings_mod.current()
    with session_scope(settings.db_url, readonly=True) as s:
        routed = [(item, queues_for(s, item)) for item in sends]
        silent = consumers.silent(s, settings, {q for _, qs in routed for q in qs})
        keys = {i: deliveries.row_key(s, item) for i, (item, _) in enumerate(routed) if item.actor in deliveries.KEYED}
    plan: list[tuple[int, Send, str, str | None]] = []
    held: list[tuple[Send, consumers.Silent]] = []
    for i, (item, queues) in enumerate(routed):
        for queue in queues:
            if queue in silent:
                held.append((item, silent[queue]))
            elif i not in keys:
                plan.append((i, item, queue, None))
            elif not deliveries.outstanding(item, keys[i], functools.partial(
                    queued, broker, queue, silent_ms=int(settings.lease_seconds * 1000))):
                plan.append((i, item, queue, deliveries.new_key(item.actor)))
    with session_scope(settings.db_url) as s:
        t = now()
        # Recorded only where the row still holds the key read above: a step another sender
        # keyed meanwhile (a second scheduler, a step sending itself again) is that one's.
        sent = [(item, queue, key) for i, item, queue, key in plan
                if key is None or deliveries.record(s, item, key, t, read=keys[i])]
        # Sent, or its message is still queued for a live consumer: not waiting for a host.
        _stop_waiting(s, [item for item, queues in routed if not silent.keys() & set(queues)])
        for item, why in held:
            _wait(s, item, why)
    ttl_ms = int(max(60.0, 4 * settings.lease_seconds) * 1000)
    for item, queue, key in sent:
        if claim_waiting(broker, queue, item.actor, item.args, ttl_ms):
            _enqueue(broker, item, queue, key)


def distinct(sends: list[Send]) -> list[Send]:
    """``sends`` with each message once, in order: a batch may name a step twice (stores that
    share contents re-driven in one tick each resume the same pending copies), and its queue
    follows from its actor and arguments."""
    seen: set[str] = set()
    out = []
    for item in sends:
        name = item.actor + json.dumps(item.args, sort_keys=True, default=str)
        if name not in seen:
            seen.add(name)
            out.append(item)
    return out


def _enqueue(broker: dramatiq.Broker, item: Send, queue: str, key: str | None) -> None:
    actor = broker.get_actor(item.actor)
    message = actor.message(*item.args)
    changes: dict[str, Any] = {}
    if queue != message.queue_name:
        # Another host's queue is never declared here: declaring a queue makes this process
        # consume it (dramatiq's worker adds a consumer), and its files are not here.
        if isinstance(broker, StubBroker) and queue not in broker.queues:
            broker.declare_queue(queue)
        changes["queue_name"] = queue
    if key is not None:
        changes["message_id"] = key
    broker.enqueue(message.copy(**changes) if changes else message)


def _wait(s: Session, item: Send, why: consumers.Silent) -> None:
    """The jobs ``item`` works for wait for the host of its silent queue (said once)."""
    reason = why.reason()
    for job_id in job_ids_for(s, item.actor, item.args):
        elsewhere = Job.waiting_for.is_(None) | (Job.waiting_for != why.queue)
        moved = s.execute(update(Job).where(Job.id == job_id, elsewhere)
                          .values(waiting_for=why.queue, blocked_reason=reason)
                          .execution_options(synchronize_session=False))
        if getattr(moved, "rowcount", 0):
            note(s, job_id, reason)
            log.warning("job %d: %s", job_id, reason)


def _stop_waiting(s: Session, sent: list[Send]) -> None:
    """The jobs of messages bound for a live consumer no longer wait for their host."""
    if not sent or s.scalar(select(Job.id).where(Job.waiting_for.is_not(None)).limit(1)) is None:
        return
    ids = {job_id for item in sent for job_id in job_ids_for(s, item.actor, item.args)}
    if not ids:
        return
    ours = Job.blocked_reason.like(consumers.WAITING + "%")
    s.execute(update(Job).where(Job.id.in_(sorted(ids)), Job.waiting_for.is_not(None))
              .values(waiting_for=None, blocked_reason=case((ours, None), else_=Job.blocked_reason))
              .execution_options(synchronize_session=False))
