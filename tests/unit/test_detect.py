"""Completeness: structure and stability, never 'size stopped changing' alone."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from pipeline.detection.completeness import examine, inspect, settled, unchanged
from pipeline.detection.roots import locate, runs
from pipeline.errors import IncompleteCheckpoint, OutsideRoots
from tests.checkpoints import dcp_folder, hf_folder


def test_dcp_directory_without_metadata_is_incomplete(tmp_path):
    d = dcp_folder(tmp_path / "step_1")
    os.unlink(d / ".metadata")
    with pytest.raises(IncompleteCheckpoint, match=".metadata"):
        inspect(d)


def test_complete_dcp_directory_includes_its_metadata_file(tmp_path):
    d = dcp_folder(tmp_path / "step_1")
    rels = {e.relpath for e in inspect(d)}
    assert ".metadata" in rels and any(r.endswith(".distcp") for r in rels)


def test_hf_index_naming_a_missing_shard_is_incomplete(tmp_path):
    d = hf_folder(tmp_path / "checkpoint-10")
    os.unlink(d / "model-00002-of-00003.safetensors")
    with pytest.raises(IncompleteCheckpoint, match="model-00002-of-00003"):
        inspect(d)


def test_hf_trainer_folder_without_trainer_state_is_incomplete(tmp_path):
    d = hf_folder(tmp_path / "checkpoint-10")
    os.unlink(d / "trainer_state.json")
    with pytest.raises(IncompleteCheckpoint, match="trainer_state.json"):
        inspect(d)


def test_half_written_safetensors_is_refused_even_when_its_size_is_stable(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(1000)}, str(p))
    p.write_bytes(p.read_bytes()[:2000])
    old = time.time() - 3600
    os.utime(p, (old, old))  # stable for an hour: still not complete
    with pytest.raises(IncompleteCheckpoint, match="truncated"):
        inspect(p)


def test_optimizer_file_alone_does_not_make_a_folder_an_hf_trainer_checkpoint(tmp_path):
    d = tmp_path / "step_5"
    d.mkdir()
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    torch.save({"lr": 1.0}, d / "optimizer.pt")
    verdict = examine(d).verdict
    assert (verdict.kind, verdict.layout) == ("quiet", "folder")  # no known layout: complete once quiet
    assert {e.relpath for e in inspect(d, quiet_seconds=0)} == {"model.safetensors", "optimizer.pt"}


def test_empty_directory_is_incomplete(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(IncompleteCheckpoint, match="empty"):
        inspect(tmp_path / "step_3")


def test_settle_window_and_change_detection(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(10)}, str(p))
    entries = inspect(p)
    assert not settled(entries, 60.0)
    assert settled(entries, 60.0, now=time.time() + 61)
    assert unchanged(entries)
    with open(p, "ab") as f:
        f.write(b"x")
    assert not unchanged(entries)


def test_paths_outside_the_roots_are_refused(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    roots = (str(tmp_path / "runs" / "*"),)
    assert runs(roots) == [(tmp_path / "runs" / "a").resolve()]
    assert locate(tmp_path / "runs" / "a" / "ckpt1", roots)[1].name == "ckpt1"
    with pytest.raises(OutsideRoots, match="not a checkpoint inside a watched root"):
        locate(tmp_path / "elsewhere" / "ckpt1", roots)
    with pytest.raises(OutsideRoots):
        locate(tmp_path / "runs" / "a" / "ckpt1" / "inner.bin", roots)


def test_index_that_is_not_json_is_reported(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text("{")
    with pytest.raises(IncompleteCheckpoint, match="not valid JSON"):
        inspect(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert inspect(d)
