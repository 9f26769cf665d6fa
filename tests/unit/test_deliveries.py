"""At most one outstanding message per job step (pipeline/deliveries.py, pipeline/tasks/sending.py).

Given a control plane at head and the Stub broker, when a step is sent, re-driven, or
delivered late, then it has one message at a time, a stale delivery does no work, and a queue
without a live consumer gets nothing while its jobs show they wait for its host.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage
from sqlalchemy import update

from pipeline import consumers, deliveries
from pipeline.db import hosts
from pipeline.db.engine import session_scope
from pipeline.db.models import Job, QueueConsumer
from pipeline.db.transitions import create_job, now
from pipeline.service.scheduler import expired_work
from pipeline.steps import Send
from tests.conftest import broker_for


@pytest.fixture
def broker(db, process_broker):
    """A Stub broker with the actors declared, in place of the process's for this test."""
    with broker_for(dataclasses.replace(db, redis_url="stub://")) as b:
        yield b


def _scrub_job(db) -> int:
    with session_scope(db.db_url) as s:
        return create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w1"}).id


def _queued(broker, queue: str = "ckpt") -> list[Message]:
    return [Message.decode(body) for body in list(broker.queues[queue].queue)]


def _send(sends: list[Send]) -> None:
    from pipeline.tasks.sending import send_all

    send_all(sends)


def test_a_re_drive_is_a_no_op_while_the_steps_message_is_still_queued(db, broker):
    job_id = _scrub_job(db)
    for _ in range(5):  # five lease periods of re-drives
        _send([Send("scrub", (job_id,))])
    queued = _queued(broker)
    assert len(queued) == 1
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).sent_key == queued[0].message_id

    broker.queues["ckpt"].get()  # the message was consumed (and lost with its worker)
    _send([Send("scrub", (job_id,))])
    again = _queued(broker)
    assert len(again) == 1 and again[0].message_id != queued[0].message_id


def test_a_stale_delivery_is_dropped_before_any_work_and_counts_no_attempt(db, broker):
    from pipeline.tasks.middleware import Deliveries

    job_id = _scrub_job(db)
    _send([Send("scrub", (job_id,))])
    first = broker.queues["ckpt"].get()
    _send([Send("scrub", (job_id,))])  # the first was taken for lost: a new key for the step
    second = broker.queues["ckpt"].get()
    middleware = Deliveries()
    with pytest.raises(SkipMessage):
        middleware.before_process_message(broker, MessageProxy(Message.decode(first)))
    middleware.before_process_message(broker, MessageProxy(Message.decode(second)))  # the current one runs
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).attempts == 0


def test_a_row_without_a_key_accepts_any_delivery(db):
    job_id = _scrub_job(db)
    with session_scope(db.db_url, readonly=True) as s:
        assert deliveries.is_current(s, "scrub", (job_id,), "scrub.from-before-the-upgrade")


def test_a_step_may_send_its_own_step_again_while_its_message_is_being_worked_on(db, broker):
    job_id = _scrub_job(db)
    _send([Send("scrub", (job_id,))])
    running = _queued(broker)[0]
    token = deliveries.CURRENT.set(running.message_id)
    try:
        _send([Send("scrub", (job_id,))])  # e.g. the step's next batch, sent by the step itself
    finally:
        deliveries.CURRENT.reset(token)
    assert len(_queued(broker)) == 2


def test_a_chain_copy_sent_since_on_its_own_is_left_to_its_own_message():
    from pipeline.db.models import ContentCopy

    head, mine, resent = (ContentCopy(id=i, sent_key=k) for i, k in
                          ((1, "replicate.a"), (2, "replicate.a"), (3, "replicate.b")))
    assert [c.id for c in deliveries.still_keyed([head, mine, resent], "replicate.a")] == [1, 2]
    assert [c.id for c in deliveries.still_keyed([head, mine, resent], None)] == [1, 2, 3]


def test_nothing_is_queued_for_a_host_whose_consumer_is_silent_and_its_jobs_say_so(db, broker):
    job_id = _scrub_job(db)
    long_ago = now() - timedelta(seconds=10 * consumers.SILENT_BEATS * db.consumer_beat_seconds)
    with session_scope(db.db_url) as s:
        s.add(QueueConsumer(queue="ckpt", host="h1", seen_at=long_ago))
        hosts.report_in(s, "h0", "box-0")  # another process alive now: this clock is not ahead
    for _ in range(3):
        _send([Send("scrub", (job_id,))])
    assert _queued(broker) == []
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        assert job.waiting_for == "ckpt"
        assert job.blocked_reason.startswith("waiting for host h1 since ")
        assert sum(1 for e in job.events if (e.detail or "").startswith("waiting for host")) == 1  # said once

    with session_scope(db.db_url) as s:  # the host is back: its consumer beats
        consumers.beat(s, "h1", ["ckpt"])
    sends = expired_work(db)  # resumed at once, not at the end of its lease
    assert sends == [Send("scrub", (job_id,))]
    _send(sends)
    assert len(_queued(broker)) == 1
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        assert job.waiting_for is None and job.blocked_reason is None


def test_a_queue_that_never_had_a_consumer_is_sent_to_as_before(db, broker):
    job_id = _scrub_job(db)
    _send([Send("scrub", (job_id,))])
    assert len(_queued(broker)) == 1


def test_a_job_no_longer_waiting_keeps_another_blocked_reason(db, broker):
    job_id = _scrub_job(db)
    with session_scope(db.db_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(waiting_for="ckpt", blocked_reason="cluster full"))
    _send([Send("scrub", (job_id,))])
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        assert job.waiting_for is None and job.blocked_reason == "cluster full"


def test_a_clock_that_runs_ahead_does_not_find_every_consumer_silent(db, broker):
    """Every sign of life is two days behind this process's clock (a scheduler whose clock
    jumped ahead): nothing is silent by that alone, and the step is sent."""
    job_id = _scrub_job(db)
    behind = now() - timedelta(days=2)
    with session_scope(db.db_url) as s:
        s.add(QueueConsumer(queue="ckpt", host="h1", seen_at=behind))
        s.add(QueueConsumer(queue="ckpt.host.h1", host="h1", seen_at=behind))
    _send([Send("scrub", (job_id,))])
    assert len(_queued(broker)) == 1
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).waiting_for is None
