"""The background protector: a save hook's declaration returns before anything is recorded,
failures are said once per run and counted in the home's ledger, and a success clears them."""
from __future__ import annotations

import logging
import threading

import pytest

from pipeline import degraded
from pipeline.errors import OutsideRoots
from pipeline.protector import Protector, explain


def test_declaring_returns_while_the_record_is_still_running(settings, tmp_path):
    release, started = threading.Event(), threading.Event()

    def slow_record(path, s):
        started.set()
        assert release.wait(30)
        return path

    p = Protector(slow_record)
    d = p.declare(tmp_path / "runs" / "a" / "checkpoint-2", settings)
    assert started.wait(30)  # the record is under way in the background...
    assert not d.done()  # ...and the trainer's call has already returned
    release.set()
    assert d.result(30) == str(tmp_path / "runs" / "a" / "checkpoint-2")


def test_failures_are_said_once_per_run_counted_and_cleared_by_a_success(settings, tmp_path, caplog):
    settings.home.mkdir(parents=True)
    fail = {"on": True}

    def record(path, s):
        if fail["on"]:
            raise OutsideRoots(path, list(s.roots))
        return path

    p = Protector(record)
    run = tmp_path / "elsewhere"
    with caplog.at_level(logging.INFO, logger="ckpt.integrations"):
        for step in (2, 4, 6):
            with pytest.raises(OutsideRoots):
                p.declare(run / f"checkpoint-{step}", settings).result(30)
        [entry] = degraded.listed(settings.home)
        assert (entry.run, entry.failures) == (str(run), 3)
        assert "not a checkpoint in a run under a watched root" in entry.cause
        assert p.failing(str(run))
        fail["on"] = False
        p.declare(run / "checkpoint-8", settings).result(30)
    said = [r.getMessage() for r in caplog.records]
    assert sum("degraded" in m for m in said) == 1, said
    assert sum("works again (3 failure(s)" in m for m in said) == 1, said
    assert degraded.listed(settings.home) == [] and not p.failing(str(run))


def test_a_path_declared_again_before_its_turn_is_recorded_once(settings, tmp_path):
    release = threading.Event()
    recorded = []

    def record(path, s):
        assert release.wait(30)
        recorded.append(path)
        return path

    p = Protector(record)
    first = p.declare(tmp_path / "blocker", settings)  # holds the thread
    older = p.declare(tmp_path / "last.ckpt", settings)
    newer = p.declare(tmp_path / "last.ckpt", settings)
    release.set()
    first.result(30), newer.result(30)
    assert older.error is not None and recorded == [str(tmp_path / "blocker"), str(tmp_path / "last.ckpt")]


def test_the_cause_points_at_the_missing_ckpt_up_not_at_unconfigured_roots(settings):
    s = settings.__class__(**{**settings.__dict__, "roots": ()})
    text = explain(OutsideRoots("/x/run/checkpoint-2", []), s)
    assert "no `ckpt up` is running" in text and "none configured" not in text


def test_a_wait_before_the_trainer_deletes_ends_when_ckpt_up_is_gone(settings):
    import json
    import os
    import subprocess
    import sys

    from pipeline.integrations.protection import up_gone

    settings.home.mkdir(parents=True)
    (settings.home / "up.json").write_text(json.dumps({"pid": os.getpid()}))
    assert up_gone(settings) is None  # running: keep waiting
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (settings.home / "up.json").write_text(json.dumps({"pid": dead.pid}))
    assert f"(pid {dead.pid}) is gone" in (up_gone(settings) or "")
    (settings.home / "up.json").unlink()
    assert up_gone(settings) is None  # no ckpt up here to ask (a remote control plane): keep waiting
