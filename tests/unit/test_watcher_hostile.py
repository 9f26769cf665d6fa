"""The watcher survives any entry: a hostile corpus in a run never stops detection of the rest.

Given a run holding one good checkpoint among entries built to break a detector (names that
are not UTF-8, runs of thousands of digits, hostile index JSON, a tree nested hundreds deep,
a safetensors header whose shape has thousands of digits or 80,000 dimensions, a DCP
.metadata that is an arbitrary pickle, symlinks out of the run), When the watcher scans,
Then it returns promptly, the good checkpoint is detected, every bad entry is reported once
(a row status, the UI and /metrics show) and skipped, and nothing outside the run is touched.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, DetectionProblem
from pipeline.detection import completeness, roots
from pipeline.detection.watcher import Watcher
from tests.checkpoints import atomic_save, state_dict


def header_file(path: Path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


class Evil:
    def __reduce__(self):  # what a plain unpickle would run
        return (os.system, ("touch /tmp/ckpt-pwned",))


def corpus(run: Path, outside: Path) -> dict[str, str]:
    """Hostile entries in ``run``; name -> what is expected ("problem" or "skipped")."""
    expect = {}
    bad_name = os.fsencode(run) + b"/step_\xff\xfe.safetensors"
    with open(bad_name, "wb") as f:
        f.write(b"not even safetensors")
    expect["step_\ufffd\ufffd.safetensors"] = "problem"
    (run / ("step_" + "9" * 240)).mkdir()  # a run of digits that is no step (int() of it would be slow)
    big = run / "big_shape.safetensors"
    header_file(big, {"t": {"dtype": "F32", "shape": [10**300] * 50, "data_offsets": [0, 4]}}, b"\0" * 4)
    expect["big_shape.safetensors"] = "problem"
    dims = run / "many_dims.safetensors"
    header_file(dims, {"t": {"dtype": "F32", "shape": [1] * 80_000, "data_offsets": [0, 4]}}, b"\0" * 4)
    expect["many_dims.safetensors"] = "problem"
    nested_json = run / "nested_index"
    nested_json.mkdir()
    (nested_json / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    expect["nested_index"] = "problem"
    escape = run / "escaping_index"
    escape.mkdir()
    (escape / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    expect["escaping_index"] = "problem"
    deep = run / "deep"
    p = deep
    for _ in range(200):
        p = p / "d"
    p.mkdir(parents=True)
    (p / "x.bin").write_bytes(b"x")
    expect["deep"] = "problem"
    dcp = run / "dcp_pickle"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(pickle.dumps(Evil()))
    (dcp / "__0_0.distcp").write_bytes(b"x")
    expect["dcp_pickle"] = "problem"
    (run / "latest").write_text("global_step500")  # DeepSpeed's tracker: a run file
    (run / "latest_checkpointed_iteration.txt").write_text("500")
    (run / "config.json").write_text("{}")
    os.symlink(outside, run / "link_out")  # a symlink out of the root: never followed, listed (issue 27)
    expect["link_out"] = "problem"
    return expect


@pytest.fixture
def hostile_run(db, tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    atomic_save(state_dict(0), outside / "precious.safetensors")
    expect = corpus(run, outside)
    good = atomic_save(state_dict(1), run / "step_7.safetensors")
    old = time.time() - 3600
    for entry in run.iterdir():
        os.utime(entry, (old, old), follow_symlinks=False)
    return run, good, outside, expect


def test_hostile_entries_are_reported_once_and_the_good_one_is_detected(db, hostile_run):
    run, good, outside, expect = hostile_run
    sent = []
    w = Watcher(db, sent.extend, use_events=False)
    w.reconcile()
    started = time.monotonic()
    w.scan()
    w.scan()
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"two scans of the corpus took {elapsed:.1f} s"
    assert [x.actor for x in sent] == ["shard"]
    with session_scope(db.db_url) as s:
        names = [c.name for c in s.scalars(select(Checkpoint))]
        problems = {Path(p.path).name: p.reason for p in s.scalars(select(DetectionProblem))}
    assert names == ["step_7.safetensors"]
    reported = {name for name, what in expect.items() if what == "problem"}
    assert reported <= set(problems), f"not reported: {reported - set(problems)}"
    assert not {"latest", "latest_checkpointed_iteration.txt", "config.json"} & set(problems)
    assert "outside the root" in problems["link_out"]
    assert not os.path.exists("/tmp/ckpt-pwned"), "a DCP .metadata was unpickled"
    assert (outside / "precious.safetensors").exists()


def test_a_problem_is_reported_once_not_at_every_scan(db, hostile_run, caplog):
    import logging

    w = Watcher(db, [].extend, use_events=False)
    with caplog.at_level(logging.ERROR, logger="ckpt.watcher"):
        for _ in range(3):
            w.scan()
    lines = [r.getMessage() for r in caplog.records if "many_dims" in r.getMessage()]
    assert len(lines) == 1, lines


def test_a_fixed_entry_leaves_the_problem_list(db, hostile_run):
    run, _good, _outside, _expect = hostile_run
    w = Watcher(db, [].extend, use_events=False)
    w.scan()
    (run / "many_dims.safetensors").unlink()
    w.scan()
    with session_scope(db.db_url) as s:
        assert "many_dims.safetensors" not in {Path(p).name for p in s.scalars(select(DetectionProblem.path))}


def test_run_files_and_links_are_not_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest").write_text("step_3")
    (run / "runs").mkdir()
    (run / "trainer_state.json").write_text("{}")
    (run / "train.log").write_text("")
    os.symlink(tmp_path, run / "latest_dir")
    (run / "checkpoint-3").mkdir()
    assert [p.name for p in roots.checkpoints_in(run)] == ["checkpoint-3"]


def test_a_glob_root_never_follows_a_symlink_out_of_itself(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    home = tmp_path / "home_dir"
    home.mkdir()
    os.symlink(home, tmp_path / "runs" / "evil")
    assert roots.runs((str(tmp_path / "runs" / "*"),)) == [(tmp_path / "runs" / "a").resolve()]


def test_a_hostile_shape_is_refused_quickly(tmp_path):
    p = tmp_path / "x.safetensors"
    header_file(p, {"t": {"dtype": "F32", "shape": [2**62] * 10_000, "data_offsets": [0, 4]}}, b"\0" * 4)
    started = time.monotonic()
    with pytest.raises(Exception, match="more elements|dimensions"):
        completeness.read_header(p)
    assert time.monotonic() - started < 1
