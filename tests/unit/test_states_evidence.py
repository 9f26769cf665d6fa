"""States from evidence (issue 29), with the real HF Trainer, real DCP saves and real storage
worker processes.

- A checkpoint whose local files the Trainer's own ``save_total_limit`` deleted is "deleted by
  the trainer", not "rotated" (rotation records its own deletions; the watcher records what it
  finds gone).
- How long an entry has waited incomplete survives a watcher's restart.
- With the default root (a run directory), a Trainer writing to ``checkpoints/hf-run`` is one
  clear message naming the fix, logged once, never once per scan; never recorded.
- Storage workers on one disk report one filesystem, and the cluster counts it once.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from pipeline import capacity
from pipeline.cluster import membership
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, DetectionProblem, DetectionWait
from pipeline.db.transitions import transition
from pipeline.detection import catalog
from pipeline.detection.watcher import Watcher
from pipeline.status import status
from tests.processes import KEY, StorageWorker, base_env
from tests.unit.test_status_view import status_text
from tests.writers.write import Tokens, tiny_qwen, trainer_args


def _train(run: Path, max_steps: int, *, resume: bool = False) -> None:
    from transformers import Trainer

    args = trainer_args(run, max_steps=max_steps, save_steps=2, save_total_limit=1)
    Trainer(model=tiny_qwen(3), args=args, train_dataset=Tokens(seed=1)).train(resume_from_checkpoint=resume or None)


def test_a_checkpoint_the_trainer_deleted_is_deleted_by_the_trainer_not_rotated(db, capsys):
    run = Path(db.roots[0].rstrip("*")) / "hf"
    _train(run, 2)
    w = Watcher(dataclasses.replace(db, quiet_seconds=0.0), [].extend, use_events=False)
    w.reconcile()
    w.scan()
    with session_scope(db.db_url) as s:  # checkpoint-2 protected (its copies are not this test's)
        ckpt = s.scalars(select(Checkpoint).where(Checkpoint.name == "checkpoint-2")).one()
        job = catalog.latest_store_job(s, ckpt.id)
        for a, b in (("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")):
            transition(s, job.id, "store", a, b)
    _train(run, 4, resume=True)  # saves checkpoint-4; save_total_limit=1 deletes checkpoint-2
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4"]
    w.scan()
    rows = {c["name"]: c for c in status(db)["checkpoints"]}
    assert (rows["checkpoint-2"]["state"], rows["checkpoint-2"]["local_copy"]) == ("verified", "deleted by the trainer")
    assert rows["checkpoint-4"]["local_copy"] == "kept"
    if db.db_url.startswith("sqlite"):  # `ckpt status` reads the home's own database
        line = next(x for x in status_text(db, capsys).splitlines() if x.endswith("checkpoint-2"))
        assert "deleted by the trainer" in line and "rotated" not in line, line


def _stuck_dcp(out: Path) -> None:
    """A torch DCP save without collectives whose rank 1 never writes its metadata."""
    import torch.distributed.checkpoint as dcp

    out.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.async_save({"w": torch.randn(8, 8)}, checkpoint_id=str(out), use_collectives=False).result()
    (out / "__1_0.distcp").write_bytes(b"x" * 100)


def test_how_long_an_entry_waited_survives_a_watcher_restart(db):
    out = Path(db.roots[0].rstrip("*")) / "r1" / "dcp_step_5"
    _stuck_dcp(out)
    s = dataclasses.replace(db, quiet_seconds=2.0)
    first = Watcher(s, [].extend, use_events=False)
    first.reconcile()
    first.scan()
    with session_scope(db.db_url) as session:
        since = session.scalars(select(DetectionWait.since)).one()
    waiting = status(db)["waiting"]
    assert [w["path"] for w in waiting] == [str(out)] and "__1_0.distcp" in waiting[0]["reason"]
    assert waiting[0]["left_s"] is None  # it waits for its writer, not for a quiet period
    time.sleep(1.2)
    again = Watcher(s, [].extend, use_events=False)  # the watcher restarts, 1.2 s into the wait
    again.reconcile()
    again.scan()
    time.sleep(1.0)
    again.scan()  # 2.2 s since nothing changed, 1 s since the restart
    with session_scope(db.db_url) as session:
        assert session.scalars(select(DetectionWait.since)).one() == since
        reasons = session.scalars(select(DetectionProblem.reason)).all()
    # Counted from before the restart (2.2 s, more on a busy machine), never from it (1 s: not yet
    # a problem at a 2 s quiet period).
    assert len(reasons) == 1 and (m := re.match(r"incomplete for (\d+) s:", reasons[0])) and int(m[1]) >= 2, reasons
    assert status(db)["waiting"] == []  # listed under "not protected" now, not twice
    shutil.rmtree(out)
    again.scan()
    with session_scope(db.db_url) as session:
        assert session.scalars(select(DetectionWait)).all() == []


def test_a_run_one_level_down_the_default_root_is_one_clear_message(db, tmp_path, caplog):
    root = tmp_path / "checkpoints"  # `ckpt up`'s default root: a run directory
    root.mkdir()
    s = dataclasses.replace(db, roots=(str(root),), quiet_seconds=0.5)
    w = Watcher(s, [].extend, use_events=False)
    w.reconcile()
    _train(root / "hf-run", 4)
    with caplog.at_level(logging.INFO, logger="ckpt.watcher"):
        for _ in range(4):
            w.scan()
            time.sleep(0.3)
        _train(root / "hf-run", 6, resume=True)  # it goes on saving: the entry changes
        for _ in range(4):
            w.scan()
            time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.name == "ckpt.watcher" and r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "'hf-run' holds checkpoint-N folders" in lines[0] and "it is a run" in lines[0]
    assert f"--root '{root}/*'" in lines[0]
    assert "trainer_state.json" not in lines[0]
    with session_scope(db.db_url) as session:
        assert session.scalars(select(Checkpoint)).all() == []  # never recorded whole
        assert len(session.scalars(select(DetectionProblem)).all()) == 1
    fixed = Watcher(dataclasses.replace(s, roots=(f"{root}/*",)), [].extend, use_events=False)
    fixed.reconcile()
    fixed.scan()
    with session_scope(db.db_url) as session:
        assert sorted(session.scalars(select(Checkpoint.name))) == ["checkpoint-6"]


@pytest.fixture
def three_workers(tmp_path):
    started = [StorageWorker(tmp_path / f"w{i}", base_env(tmp_path / "home"), tmp_path / f"w{i}.log")
               for i in range(3)]
    try:
        for w in started:
            w.start()
        yield started
    finally:
        for w in started:
            w.stop()


def test_workers_on_one_disk_report_one_filesystem_counted_once(db, three_workers):
    s = dataclasses.replace(db, cluster_key=KEY)
    membership.probe_all(s, tuple(w.url for w in three_workers))
    disk = shutil.disk_usage(three_workers[0].data)
    with session_scope(db.db_url) as s:
        u = capacity.usage(s, db)
    assert (u.workers, u.filesystems) == (3, 1)
    assert u.capacity == disk.total


def test_what_is_a_run_one_level_down():
    from pipeline.core.layouts import nested_run

    assert "holds checkpoint-N folders" in nested_run("hf-run", ["checkpoint-2", "runs"], "/c")
    assert "holds global_stepN folders" in nested_run("ds-run", ["global_step5"], "/c")
    assert nested_run("checkpoint-500", ["global_step500"], "/c") is None  # the Trainer under DeepSpeed
    assert nested_run("iter_0000500", ["mp_rank_00", "mp_rank_01"], "/c") is None  # Megatron's ranks
    assert nested_run("model", ["0"], "/c") is None  # one folder of digits is no run
    assert "holds N folders" in nested_run("orbax-run", ["100", "200"], "/c")
