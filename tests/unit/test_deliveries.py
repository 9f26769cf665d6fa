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


# -- one batch, one message per step ---------------------------------------------------------

def _all_queued(broker) -> list[Message]:
    return [Message.decode(body) for q in broker.queues.values() for body in list(q.queue)]


def test_one_batch_naming_a_step_twice_queues_one_message(db, broker):
    """send_all read every row's key before it recorded any: a batch holding the same keyed
    step twice recorded two fresh keys (the first overwritten) and enqueued both."""
    job_id = _scrub_job(db)
    _send([Send("scrub", (job_id,)), Send("scrub", (job_id,))])
    queued = _all_queued(broker)
    assert len(queued) == 1, [m.message_id for m in queued]
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).sent_key == queued[0].message_id


def _record(s, path, host="node-a"):
    from pipeline.db.transitions import transition
    from pipeline.detection import catalog, completeness, roots

    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as ses:
        ckpt, job, _created = catalog.record(ses, detected, lease_seconds=60, detail="test", host=host)
        transition(ses, job.id, "store", "detected", "sharded")
        return ckpt.id, job.id


def test_a_re_drive_of_two_stores_sharing_content_queues_one_message_per_copy(db, broker, tmp_path):
    """Two saves with the same bytes (a fine-tune's frozen layers, one model saved in two runs)
    share their contents and so their pending copies. When both stores' leases end in one tick,
    expired_work resumes each with replicate(copy) for every pending copy of its contents: the
    same copy twice in one batch, so two messages per copy per re-drive (N stores: N)."""
    from pipeline import settings as settings_mod
    from pipeline.db.models import Checkpoint, ContentCopy, StorageWorker
    from tests.checkpoints import atomic_save, state_dict

    s = settings_mod.configure(dataclasses.replace(db, rf=1))
    for run in ("r1", "r2"):
        (tmp_path / "runs" / run).mkdir()
    a = atomic_save(state_dict(7), tmp_path / "runs" / "r1" / "step_1.safetensors")
    b = atomic_save(state_dict(7), tmp_path / "runs" / "r2" / "step_1.safetensors")
    (ca, ja), (cb, jb) = _record(s, a), _record(s, b)
    with session_scope(s.db_url) as ses:
        ses.add(StorageWorker(id="w1", url="http://127.0.0.1:1", source="static", state="up", last_seen=now()))
        ses.flush()
        shas = {sh.sha256 for f in ses.get(Checkpoint, ca).files for sh in f.shards}
        assert shas == {sh.sha256 for f in ses.get(Checkpoint, cb).files for sh in f.shards}
        for sha in sorted(shas):
            ses.add(ContentCopy(sha256=sha, worker_id="w1", state="pending", attempts=0))
        for j in (ja, jb):
            ses.get(Job, j).lease_until = now() - timedelta(seconds=5)
    _send(expired_work(s))
    per_copy: dict[int, int] = {}
    for m in _all_queued(broker):
        if m.actor_name == "replicate":
            per_copy[m.args[0]] = per_copy.get(m.args[0], 0) + 1
    assert per_copy and max(per_copy.values()) == 1, per_copy


def test_a_step_keyed_by_another_sender_meanwhile_is_not_sent_again(db, broker, monkeypatch):
    """Two senders (two schedulers in one tick, a re-drive beside a step sending itself) both
    read the step's key as it was, then each recorded its own and enqueued: two messages. A key
    is recorded only where the row still holds the one read, so the second sends nothing."""
    job_id = _scrub_job(db)
    real = deliveries.outstanding
    raced = []

    def outstanding(send, key, queued):
        if not raced:  # between this sender's read and its write, another sends the step
            raced.append(True)
            _send([Send("scrub", (job_id,))])
        return real(send, key, queued)

    monkeypatch.setattr(deliveries, "outstanding", outstanding)
    _send([Send("scrub", (job_id,))])
    queued = _all_queued(broker)
    assert len(queued) == 1, [m.message_id for m in queued]
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).sent_key == queued[0].message_id


def test_a_batch_naming_an_unkeyed_message_twice_queues_it_once(db, broker):
    _send([Send("rotate_run", ("/runs/a",)), Send("rotate_run", ("/runs/a",)), Send("rotate_run", ("/runs/b",))])
    assert sorted(m.args[0] for m in _all_queued(broker)) == ["/runs/a", "/runs/b"]


def test_a_look_again_message_waits_once_per_queue_and_arguments(db, broker):
    """Found by the chaos soak: every finished repair and every sweep sent a ``rotate_run`` for
    the runs it touched; with the host's consumer busy on a slow link, 97 piled up in its queue."""
    for _ in range(5):
        _send([Send("rotate_run", ("/runs/a",))])
        _send([Send("rotate_run", ("/runs/b",))])
    assert sorted(m.args[0] for m in _all_queued(broker)) == ["/runs/a", "/runs/b"]
    broker.queues["ckpt"].get()  # one is taken: a request made now is sent (its run may have changed)
    _send([Send("rotate_run", ("/runs/a",)), Send("rotate_run", ("/runs/b",))])
    assert len(_all_queued(broker)) == 2


def test_a_look_again_message_waits_once_in_redis_and_is_sent_again_once_a_worker_starts_on_it(
        db, redis_server, process_broker):
    from pipeline.tasks.middleware import Deliveries

    redis_server.flushall()
    settings = dataclasses.replace(db, redis_url=f"unix://{redis_server.socket_file}")
    with broker_for(settings) as rb:
        for _ in range(5):
            _send([Send("rotate_run", ("/runs/a",))])
        assert rb.client.llen(f"{rb.namespace}:ckpt") == 1
        (mid,) = rb.client.lrange(f"{rb.namespace}:ckpt", 0, -1)
        message = Message.decode(rb.client.hget(f"{rb.namespace}:ckpt.msgs", mid))
        Deliveries().before_process_message(rb, MessageProxy(message))  # a worker starts on it
        _send([Send("rotate_run", ("/runs/a",))])
        _send([Send("rotate_run", ("/runs/a",))])
        assert rb.client.llen(f"{rb.namespace}:ckpt") == 2
