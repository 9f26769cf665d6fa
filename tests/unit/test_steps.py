"""Attempts are counted in the job row, crash redeliveries included."""
from __future__ import annotations

import pytest

from pipeline.db.engine import session_scope
from pipeline.db.models import Job
from pipeline.db.transitions import create_job
from pipeline.errors import AttemptsExhausted
from pipeline.steps import begin_step, fail_job


def test_a_step_gives_up_after_max_attempts(db):
    with session_scope(db.db_url) as s:
        job_id = create_job(s, "store", checkpoint_id=None).id
    for _ in range(db.max_attempts):  # e.g. deliveries whose worker was killed mid-step
        with session_scope(db.db_url) as s:
            assert begin_step(s, db, job_id, "detected") is not None
    with pytest.raises(AttemptsExhausted, match=f"gave up after {db.max_attempts} attempts"):
        with session_scope(db.db_url) as s:
            begin_step(s, db, job_id, "detected")


def test_a_delivery_for_a_finished_step_does_nothing(db):
    with session_scope(db.db_url) as s:
        job = create_job(s, "store", checkpoint_id=None)
        job.state = "verified"
        job_id = job.id
    with session_scope(db.db_url) as s:
        assert begin_step(s, db, job_id, "detected") is None
        assert s.get(Job, job_id).attempts == 0


def test_failing_remembers_where_to_resume(db):
    with session_scope(db.db_url) as s:
        job_id = create_job(s, "store", checkpoint_id=None).id
    with session_scope(db.db_url) as s:
        assert fail_job(s, job_id, "boom")
    with session_scope(db.db_url) as s:
        job = s.get(Job, job_id)
        assert (job.state, job.last_error, job.params["failed_from"]) == ("failed", "boom", "detected")
        assert not fail_job(s, job_id, "again")


def test_leases_are_kept_by_time_only_for_jobs_still_being_worked_on(db):
    """leased() renews from a helper thread while the block runs (one long upload); a job that
    ended meanwhile is left alone."""
    import dataclasses
    import time

    from pipeline.db.transitions import now, transition
    from pipeline.leases import extend, leased

    s = dataclasses.replace(db, lease_seconds=1.0)  # renewed every third of it
    with session_scope(s.db_url) as ses:
        working = create_job(ses, "scrub", checkpoint_id=None, lease_seconds=1.0).id
        ended = create_job(ses, "scrub", checkpoint_id=None, lease_seconds=1.0).id
        transition(ses, ended, "scrub", "queued", "failed")
    assert extend(s, [working, ended]) == 1
    with leased(s, [working]):
        time.sleep(2.5)  # two and a half leases
        with session_scope(s.db_url) as ses:
            assert ses.get(Job, working).lease_until > now()  # still held
    time.sleep(1.3)
    with session_scope(s.db_url) as ses:
        assert ses.get(Job, working).lease_until < now()  # and free to expire once the block is over
        assert ses.get(Job, ended).lease_until is None
