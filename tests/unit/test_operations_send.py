"""A request whose message cannot be sent (Redis down while `ckpt up` restarts) is recorded and
said so; it never fails the caller with a broker traceback (the scheduler re-drives it)."""
from __future__ import annotations

import dataclasses
import logging

import dramatiq

from pipeline import operations
from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.db.transitions import create_job
from pipeline.steps import Send


def test_a_request_whose_broker_is_down_is_recorded_and_not_raised(db, process_broker, tmp_path, caplog):
    from pipeline.tasks.broker import build_broker  # not at collection: importing pipeline.tasks installs a broker

    installed = dramatiq.get_broker()
    down = build_broker(dataclasses.replace(db, redis_url=f"unix://{tmp_path / 'no-redis.sock'}"))
    for name in installed.get_declared_actors():
        down.declare_actor(installed.get_actor(name))
    with session_scope(db.db_url) as s:
        job_id = create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w1"}).id
    dramatiq.set_broker(down)
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt.operations"):
            operations._send([Send("scrub", (job_id,))])
    finally:
        dramatiq.set_broker(installed)
    assert "could not be sent now" in caplog.text and "ConnectionError" in caplog.text
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "queued"  # recorded: the scheduler re-drives it
