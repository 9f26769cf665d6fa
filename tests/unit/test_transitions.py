"""The state machine as data, and the one transition function, on SQLite and PostgreSQL."""
from __future__ import annotations

from itertools import pairwise

import pytest
from sqlalchemy import select

from pipeline import states
from pipeline.db.engine import session_scope
from pipeline.db.models import Job, JobEvent
from pipeline.db.transitions import create_job, transition
from pipeline.errors import InvalidTransition


def all_pairs(kind: str):
    names = sorted(states.all_states(kind))
    return [(kind, a, b) for a in names for b in names if a != b]


ILLEGAL = [p for k in ("store", "restore") for p in all_pairs(k) if not states.allowed(*p)]
LEGAL = [p for k in ("store", "restore") for p in all_pairs(k) if states.allowed(*p)]


def test_store_happy_path_is_declared():
    path = ["detected", "sharded", "replicated", "verified", "rotated"]
    assert all(states.allowed("store", a, b) for a, b in pairwise(path))
    path = ["queued", "gathering", "verified", "done"]
    assert all(states.allowed("restore", a, b) for a, b in pairwise(path))


def test_terminal_states_have_no_way_out_but_requeue_or_newer_content():
    """Only a person (requeue from failed), retention (forgotten) or a new checkpoint at the
    same path (superseded) moves a job that ended."""
    for kind in ("store", "restore"):
        for state in states.TERMINAL[kind] - {"failed"}:
            assert states.TRANSITIONS[kind][state] <= {"superseded", "forgotten"}, (kind, state)
    assert states.allowed("store", "rotated", "superseded") and states.allowed("store", "verified", "superseded")
    assert not states.TRANSITIONS["store"]["superseded"] and not states.TRANSITIONS["store"]["vanished"]


def _job_in(s, kind: str, state: str) -> int:
    job = create_job(s, kind, checkpoint_id=None)
    s.flush()
    job.state = state  # test setup only: put the job where the case starts
    s.flush()
    return job.id


@pytest.mark.parametrize("kind,current,target", ILLEGAL)
def test_every_illegal_transition_raises(db, kind, current, target):
    with session_scope(db.db_url) as s:
        job_id = _job_in(s, kind, current)
    with pytest.raises(InvalidTransition), session_scope(db.db_url) as s:
        transition(s, job_id, kind, current, target)
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == current


@pytest.mark.parametrize("kind,current,target", LEGAL)
def test_every_legal_transition_moves_and_writes_the_timeline(db, kind, current, target):
    with session_scope(db.db_url) as s:
        job_id = _job_in(s, kind, current)
    with session_scope(db.db_url) as s:
        assert transition(s, job_id, kind, current, target, detail="why") is True
    with session_scope(db.db_url) as s:
        assert s.get(Job, job_id).state == target
        last = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc())).first()
        assert (last.from_state, last.to_state, last.detail) == (current, target, "why")


def test_a_repeated_transition_is_a_no_op(db):
    with session_scope(db.db_url) as s:
        job_id = create_job(s, "store", checkpoint_id=None).id
    with session_scope(db.db_url) as s:
        assert transition(s, job_id, "store", "detected", "sharded")
    with session_scope(db.db_url) as s:
        assert transition(s, job_id, "store", "detected", "sharded") is False
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)).all()
        assert [e.to_state for e in events] == ["detected", "sharded"]


def test_compare_and_set_refuses_a_stale_expectation(db):
    with session_scope(db.db_url) as s:
        job_id = create_job(s, "store", checkpoint_id=None).id
    with session_scope(db.db_url) as s:
        transition(s, job_id, "store", "detected", "sharded")
        transition(s, job_id, "store", "sharded", "replicated")
    # A late delivery still believing the job is 'detected' cannot move it.
    with pytest.raises(InvalidTransition, match="cannot go from 'replicated' to 'sharded'"):
        with session_scope(db.db_url) as s:
            transition(s, job_id, "store", "detected", "sharded")


def test_a_checkpoint_shows_the_state_of_its_newest_store_job(db):
    """create_job() and transition() keep Checkpoint.store_state; a late transition of an older
    store job of the same checkpoint does not overwrite what the newer one says, and jobs of
    other kinds never touch it."""
    from pipeline.db.models import Checkpoint

    with session_scope(db.db_url) as s:
        c = Checkpoint(path="/r/c", run="/r", name="c", is_dir=False, version="v", mtime=0.0, total_bytes=1)
        s.add(c)
        s.flush()
        cid = c.id
        old = create_job(s, "store", checkpoint_id=cid).id

    def shown() -> str | None:
        with session_scope(db.db_url) as s:
            return s.scalar(select(Checkpoint.store_state).where(Checkpoint.id == cid))

    assert shown() == "detected"
    with session_scope(db.db_url) as s:
        transition(s, old, "store", "detected", "sharded")
    assert shown() == "sharded"
    with session_scope(db.db_url) as s:
        new = create_job(s, "store", checkpoint_id=cid).id
        create_job(s, "restore", checkpoint_id=cid)
    assert shown() == "detected"
    with session_scope(db.db_url) as s:
        transition(s, old, "store", "sharded", "failed")
    assert shown() == "detected"
    with session_scope(db.db_url) as s:
        for a, b in pairwise(["detected", "sharded", "replicated", "verified"]):
            transition(s, new, "store", a, b)
    assert shown() == "verified"
