"""A step's follow-ups marked ``here`` continue in the thread that decided them, for the queues
this process consumes; everything else is sent (pipeline/tasks/inline.py).

Given a control plane at head, the Stub broker and a Dramatiq worker of this process that
consumes some queues, when a step's follow-ups are carried on, then those marked ``here`` for a
consumed queue run now (and so do theirs, up to a bound), the others are enqueued, and one
that fails is recorded on its job and enqueued for the workers.
"""
from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
from dramatiq import Message
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Job, JobEvent
from pipeline.db.transitions import create_job
from pipeline.queues import SHARED, host_queue
from pipeline.steps import Send
from pipeline.tasks import inline
from tests.conftest import broker_for


@pytest.fixture
def broker(db, process_broker):
    with broker_for(dataclasses.replace(db, redis_url="stub://")) as b:
        yield b


@pytest.fixture
def serving():
    """This process's Dramatiq worker consumes the queues a test names (none until it does)."""
    inline.serve(None)

    def serve(*queues: str) -> None:
        inline.serve(SimpleNamespace(consumers={q: None for q in queues} | {f"{q}.DQ": None for q in queues}))
    yield serve
    inline.serve(None)


def _job(db) -> int:
    with session_scope(db.db_url) as s:
        return create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w1"}).id


def _queued(broker, queue: str = SHARED) -> list[tuple[str, tuple]]:
    if queue not in broker.queues:
        return []
    return [(m.actor_name, tuple(m.args)) for m in (Message.decode(b) for b in list(broker.queues[queue].queue))]


def test_a_marked_follow_up_for_a_consumed_queue_runs_here_and_the_rest_is_sent(db, broker, serving):
    serving(SHARED)
    ran: list[Send] = []

    def step(m: Send) -> list[Send]:
        ran.append(m)
        return [Send("rotate_part", (m.args[0], "h"))]  # its own follow-up, not marked: sent

    inline.carry_on([Send("recheck", (1,), here=True), Send("recheck", (2,))], {"recheck": step})
    assert [m.args for m in ran] == [(1,)]
    assert _queued(broker) == [("recheck", (2,))]
    assert _queued(broker, host_queue("h")) == [("rotate_part", (1, "h"))]


def test_nothing_runs_here_for_a_queue_this_process_does_not_consume(db, broker, serving):
    ran: list[Send] = []
    steps = {"recheck": lambda m: ran.append(m) or []}
    inline.carry_on([Send("recheck", (1,), here=True)], steps)  # no Dramatiq worker in this process
    serving(host_queue("elsewhere"))  # a worker of another queue only: verify goes to the shared one
    inline.carry_on([Send("recheck", (2,), here=True)], steps)
    serving(SHARED)
    inline.carry_on([Send("reconcile_worker", ("w3",), here=True)], steps)  # no step to continue it with
    assert ran == []
    assert _queued(broker) == [("recheck", (1,)), ("recheck", (2,)), ("reconcile_worker", ("w3",))]


def test_continuations_are_bounded_and_the_next_is_sent(db, broker, serving):
    serving(SHARED)
    ran: list[int] = []

    def again(m: Send) -> list[Send]:
        ran.append(m.args[0])
        return [Send("recheck", (m.args[0] + 1,), here=True)]

    inline.carry_on([Send("recheck", (0,), here=True)], {"recheck": again})
    assert ran == list(range(inline.MAX_STEPS))
    assert _queued(broker) == [("recheck", (inline.MAX_STEPS,))]


def test_a_continuation_that_fails_is_recorded_on_its_job_and_sent(db, broker, serving):
    serving(SHARED)
    job_id = _job(db)
    after: list[Send] = []

    def scrub(m: Send) -> list[Send]:
        raise OSError("the worker went away")

    inline.carry_on([Send("scrub", (job_id,), here=True), Send("recheck", (9,), here=True)],
                    {"scrub": scrub, "recheck": lambda m: after.append(m) or []})
    assert _queued(broker) == [("scrub", (job_id,))]
    assert [m.args for m in after] == [(9,)]  # the next continuation still ran
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        assert job.sent_key == Message.decode(list(broker.queues[SHARED].queue)[0]).message_id  # keyed as any send
        notes = s.scalars(select(JobEvent.detail).where(JobEvent.job_id == job_id)).all()
    assert any("scrub: OSError: the worker went away" in (n or "") for n in notes), notes


def test_an_interrupted_continuation_sends_itself_and_those_not_run_yet(db, broker, serving):
    serving(SHARED)

    class Interrupted(BaseException):
        pass

    def stop(m: Send) -> list[Send]:
        raise Interrupted

    with pytest.raises(Interrupted):
        inline.carry_on([Send("recheck", (1,), here=True), Send("recheck", (2,), here=True)], {"recheck": stop})
    assert _queued(broker) == [("recheck", (1,)), ("recheck", (2,))]


def test_a_step_running_in_another_thread_here_is_sent_not_run_twice(db, broker, serving):
    serving(SHARED)
    inside, release = threading.Event(), threading.Event()
    ran: list[tuple] = []

    def slow(m: Send) -> list[Send]:
        ran.append(m.args)
        inside.set()
        release.wait(10)
        return []

    steps = {"recheck": slow}
    first = threading.Thread(target=inline.carry_on, args=([Send("recheck", (1,), here=True)], steps))
    first.start()
    assert inside.wait(10)
    inline.carry_on([Send("recheck", (1,), here=True)], steps)  # asked again while it runs: a message
    release.set()
    first.join(10)
    assert ran == [(1,)]
    assert _queued(broker) == [("recheck", (1,))]
    inline.carry_on([Send("recheck", (1,), here=True)], steps)  # done: runs here again
    assert ran == [(1,), (1,)]
