"""A run's rotation pass (pipeline.store.rotation.plan_run) runs after every verified save: it
asks for the rotation of every verified checkpoint beyond the newest ``keep_last``, says why the
others wait, and reads their store jobs in a fixed number of queries, however far behind."""
from __future__ import annotations

import dataclasses

import torch
from sqlalchemy import event, select

from pipeline.db.engine import get_engine, session_scope
from pipeline.db.models import Checkpoint, Job
from pipeline.db.transitions import transition
from pipeline.detection import catalog, completeness
from pipeline.states import JobKind
from pipeline.states import StoreState as S
from pipeline.steps import Send
from pipeline.store.rotation import plan_run
from tests.checkpoints import atomic_save


def _saves(db, run, steps: range, *, verified: bool) -> list[int]:
    """Record a save per step (tiny files), their store jobs moved on to verified or left detected."""
    ids = []
    for step in steps:
        path = atomic_save({"w": torch.full((4,), float(step))}, run / f"step_{step}.safetensors")
        ids.append(_record_at(db, run, path))
        if verified:
            _verify(db, ids[-1])
    return ids


def _verify(db, job_id: int) -> None:
    with session_scope(db.db_url) as s:
        for a, b in ((S.DETECTED, S.SHARDED), (S.SHARDED, S.REPLICATED), (S.REPLICATED, S.VERIFIED)):
            transition(s, job_id, JobKind.STORE, a, b)


def _record_at(db, run, path) -> int:
    """Record the checkpoint at ``path``: its store job's id."""
    d = catalog.hash_checkpoint(run, path, completeness.inspect(path), shard_size=db.shard_size)
    with session_scope(db.db_url) as s:
        return catalog.record(s, d, lease_seconds=60, detail="test", host=db.host_id)[1].id


def _planned(db, run) -> tuple[list[Send], int]:
    """What plan_run sends, and how many statements it ran."""
    ran: list[str] = []

    def count(conn, cursor, statement, *args):
        ran.append(statement)

    engine = get_engine(db.db_url)
    event.listen(engine, "before_cursor_execute", count)
    try:
        sends = plan_run(db, str(run))
    finally:
        event.remove(engine, "before_cursor_execute", count)
    return sends, len(ran)


def test_the_rotation_pass_reads_a_runs_store_jobs_in_as_many_queries_however_far_behind(db, tmp_path):
    db = dataclasses.replace(db, keep_last=3)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    verified = _saves(db, run, range(1, 9), verified=True)
    waiting = _saves(db, run, range(9, 13), verified=False)
    sends, few = _planned(db, run)
    # steps 1-8 are verified and beyond the newest three: rotated; 9 waits for its verify
    assert sorted(send.args[0] for send in sends) == verified and {send.actor for send in sends} == {"rotate"}
    with session_scope(db.db_url) as s:
        reasons = dict(s.execute(select(Checkpoint.step, Job.blocked_reason)
                                 .join(Job, Job.checkpoint_id == Checkpoint.id).where(Job.id.in_(waiting))).all())
    assert reasons == {9: "rotation waits: the checkpoint is detected, not yet verified", 10: None, 11: None, 12: None}

    more = _saves(db, run, range(13, 41), verified=True)
    sends, many = _planned(db, run)
    assert sorted(send.args[0] for send in sends) == [*verified, *more[:-3]]
    assert many == few, f"{few} statements with 12 local saves, {many} with 40"


def _saved_back(db, tmp_path):
    """keep_last 1; step_1 verified, overwritten by other bytes, then saved back with its first
    bytes (its checkpoint has a second store job, detected), and two verified saves after it:
    (settings, run, the first store job, the second)."""
    db = dataclasses.replace(db, keep_last=1)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    first = _saves(db, run, range(1, 2), verified=True)[0]
    path = run / "step_1.safetensors"
    atomic_save({"w": torch.full((4,), 99.0)}, path)  # other bytes at the same path
    _record_at(db, run, path)
    atomic_save({"w": torch.full((4,), 1.0)}, path)  # the first bytes back
    again = _record_at(db, run, path)
    assert again > first
    _saves(db, run, range(2, 4), verified=True)
    return db, run, first, again


def test_a_resaved_checkpoint_is_rotated_by_its_newest_store_job_never_by_an_older_verified_one(db, tmp_path):
    """A save verified, overwritten by other bytes, then saved back with its first bytes: its
    checkpoint has two store jobs, the old one verified then superseded. The one query's newest
    job decides: while it is not verified, the save is not rotated (the old job's verify does not
    count), and a failed newest job never is; once it is verified, it is rotated by that job."""
    db, run, first, again = _saved_back(db, tmp_path)
    sends, _ = _planned(db, run)
    assert first not in [x.args[0] for x in sends] and again not in [x.args[0] for x in sends]
    with session_scope(db.db_url) as s:
        assert s.get(Job, again).blocked_reason == "rotation waits: the checkpoint is detected, not yet verified"
        transition(s, again, JobKind.STORE, S.DETECTED, S.FAILED)
    sends, _ = _planned(db, run)
    assert first not in [x.args[0] for x in sends] and again not in [x.args[0] for x in sends]


def test_a_resaved_checkpoint_whose_newest_job_is_verified_is_rotated_by_that_job(db, tmp_path):
    """The same save back at its path, its second store job verified: rotated by that job."""
    db, run, first, again = _saved_back(db, tmp_path)
    _verify(db, again)
    sends, _ = _planned(db, run)
    assert again in [x.args[0] for x in sends] and first not in [x.args[0] for x in sends]
