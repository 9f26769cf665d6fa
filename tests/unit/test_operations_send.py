"""A request whose message cannot be sent (Redis down while `ckpt up` restarts) is recorded and
said so; it never fails the caller with a broker traceback (the scheduler re-drives it)."""
from __future__ import annotations

import dataclasses
import logging

from pipeline import operations
from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.db.transitions import create_job
from pipeline.steps import Send
from tests.conftest import broker_for


def test_a_request_whose_broker_is_down_is_recorded_and_not_raised(db, process_broker, tmp_path, caplog):
    with session_scope(db.db_url) as s:
        job_id = create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w1"}).id
    with broker_for(dataclasses.replace(db, redis_url=f"unix://{tmp_path / 'no-redis.sock'}")):
        with caplog.at_level(logging.WARNING, logger="ckpt.operations"):
            operations._send([Send("scrub", (job_id,))])
    assert "could not be sent now" in caplog.text and "ConnectionError" in caplog.text
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == "queued"  # recorded: the scheduler re-drives it
