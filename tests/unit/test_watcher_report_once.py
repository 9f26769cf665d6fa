"""A problem is logged once per kind, not at every scan (issue 27).

Given an entry stuck incomplete whose reason carries numbers that change at every scan
(seconds waited), When the watcher scans it again and again, Then it logs the problem once
(the problem row keeps the latest words), and once more only when the problem changes kind.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import torch
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import DetectionProblem
from pipeline.detection import problems
from pipeline.detection.watcher import Watcher


def test_kind_of_masks_numbers_only():
    kind = problems.kind_of
    assert kind("incomplete for 61 s: 1 of 3 shards") == kind("incomplete for 90 s: 2 of 3 shards")
    assert problems.kind_of("incomplete for 61 s: a") != problems.kind_of("incomplete for 61 s: b")


def test_a_stuck_save_is_logged_once_while_its_seconds_grow_and_again_when_its_kind_changes(db, tmp_path, caplog):
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "runs" / "r1"
    out = run / "dcp_step_5"
    out.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.async_save({"w": torch.randn(8, 8)}, checkpoint_id=str(out), use_collectives=False).result()
    (out / "__1_0.distcp").write_bytes(b"x" * 100)  # rank 1: its metadata never comes
    w = Watcher(dataclasses.replace(db, quiet_seconds=0.0), [].extend, use_events=False)
    with caplog.at_level(logging.ERROR, logger="ckpt.watcher"):
        reasons = []
        for _ in range(4):
            w.scan()
            with session_scope(db.db_url) as s:
                reasons += s.scalars(select(DetectionProblem.reason)).all()
            time.sleep(1.05)
        lines = [r.getMessage() for r in caplog.records if r.name == "ckpt.watcher" and "dcp_step_5" in r.getMessage()]
        assert len(lines) == 1, lines
        assert len(set(reasons)) > 1, f"the row keeps the latest words: {reasons}"
        (out / "__1.metadata").write_bytes(b"not a pickle")  # now malformed: another kind
        w.scan()
        lines = [r.getMessage() for r in caplog.records if r.name == "ckpt.watcher" and "dcp_step_5" in r.getMessage()]
    assert len(lines) == 2 and "__1.metadata" in lines[1], lines
