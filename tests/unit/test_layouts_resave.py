"""Layouts real writers leave when they save again in place, or without collectives (issue 27).

Given a folder that a real writer saved into twice (transformers ``save_pretrained`` sharded,
then unsharded: it deletes the old shards, keeps the old index), or a torch DCP step saved
without collectives (each rank writes ``__<rank>.metadata``), When the watcher scans it,
Then the finished save is recorded as a checkpoint, and no state of a save still in progress
(interrupted at every point that matters) is ever judged complete.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointPart, DetectionProblem
from pipeline.detection import completeness
from pipeline.detection.watcher import Watcher
from pipeline.errors import IncompleteCheckpoint
from tests.writers.write import tiny_qwen

SHARDED = "200KB"
LARGER = "300KB"


class Interrupted(Exception):
    """Raised by the spy in place of the writer's next file: the save stops there."""


def interrupted_save(model, out: Path, monkeypatch, *, after: int, **kwargs) -> None:
    """``model.save_pretrained(out, **kwargs)`` stopped after its first ``after`` weights
    files, or before its index when that is all of them (as a killed trainer leaves it)."""
    import transformers.modeling_utils as mu

    real, done = mu.safe_save_file, []

    def save(tensors, filename, metadata=None):
        if len(done) == after:
            raise Interrupted(filename)
        real(tensors, filename, metadata=metadata)
        done.append(filename)

    def no_index(file, mode="r", *args, **kw):
        if str(file).endswith(".index.json") and "w" in mode:
            raise Interrupted(file)
        return open(file, mode, *args, **kw)

    monkeypatch.setattr(mu, "safe_save_file", save)
    monkeypatch.setattr(mu, "open", no_index, raising=False)
    with pytest.raises(Interrupted):
        model.save_pretrained(out, **kwargs)
    monkeypatch.undo()


def shards(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("model-*-of-*.safetensors"))


def assert_not_complete(out: Path) -> None:
    """Not complete by structure, and not by the quiet period either while it is fresh."""
    with pytest.raises(IncompleteCheckpoint):
        completeness.inspect(out, quiet_seconds=60)


def make_watcher(db):
    sent: list = []
    return Watcher(db, sent.extend, use_events=False), sent


def current(db, path: Path) -> Checkpoint | None:
    with session_scope(db.db_url) as s:
        return s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))


# -- save_pretrained sharded, then unsharded, into one folder ----------------------------------

def test_transformers_keeps_the_old_index_when_it_saves_unsharded_over_a_sharded_save(tmp_path):
    out = tmp_path / "model_step_1"
    tiny_qwen(1).save_pretrained(out, max_shard_size=SHARDED)
    assert len(shards(out)) > 1
    time.sleep(0.01)
    tiny_qwen(2).save_pretrained(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert shards(out) == [], "transformers deletes the old shards"
    assert set(index["weight_map"].values()), "and keeps the index naming them"
    v = completeness.examine(out).verdict
    assert v.complete, v


def test_an_unsharded_resave_over_a_sharded_one_is_detected_as_a_new_version(db, tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    out = run / "model_step_1"
    tiny_qwen(1).save_pretrained(out, max_shard_size=SHARDED)
    w, sent = make_watcher(db)
    w.scan()
    first = current(db, out)
    assert first is not None and first.layout == "hf-sharded"
    time.sleep(0.01)
    tiny_qwen(2).save_pretrained(out)
    w.scan()
    second = current(db, out)
    assert second is not None and second.id != first.id, "the unsharded re-save was not recorded"
    assert [x.actor for x in sent] == ["shard", "shard"]
    with session_scope(db.db_url) as s:
        names = {f.relpath for f in s.get(Checkpoint, second.id).files}
        assert "model.safetensors" in names and not s.scalars(select(DetectionProblem)).all()


def test_a_sharded_resave_in_progress_over_an_unsharded_one_is_never_complete(tmp_path, monkeypatch):
    out = tmp_path / "model_step_1"
    tiny_qwen(1).save_pretrained(out, max_shard_size=SHARDED)
    n = len(shards(out))
    time.sleep(0.01)
    tiny_qwen(2).save_pretrained(out)  # the folder now holds a stale index and model.safetensors
    assert completeness.examine(out).verdict.complete
    time.sleep(0.01)
    # Larger shards: other names than the stale index's. At every point (some shards written,
    # or all but not their index yet) the save is not complete.
    probe = tmp_path / "probe"
    tiny_qwen(3).save_pretrained(probe, max_shard_size=LARGER)
    m = len(shards(probe))
    assert 1 < m < n
    for after in range(1, m + 1):
        interrupted_save(tiny_qwen(3), out, monkeypatch, after=after, max_shard_size=LARGER)
        assert len(shards(out)) == after
        assert_not_complete(out)
    tiny_qwen(3).save_pretrained(out, max_shard_size=LARGER)
    assert completeness.examine(out).verdict.complete


def test_a_resave_with_the_same_shard_names_is_complete_only_with_its_new_index(tmp_path, monkeypatch):
    """The old index names every shard and old shards fill the gaps: by names alone a save
    halfway through looks complete. The index is written last, so a shard newer than it
    means a save at work."""
    out = tmp_path / "model_step_1"
    tiny_qwen(1).save_pretrained(out, max_shard_size=SHARDED)
    names = shards(out)
    time.sleep(0.01)
    for after in range(1, len(names) + 1):
        interrupted_save(tiny_qwen(2), out, monkeypatch, after=after, max_shard_size=SHARDED)
        assert shards(out) == names
        assert_not_complete(out)
    time.sleep(0.01)
    tiny_qwen(2).save_pretrained(out, max_shard_size=SHARDED)
    assert completeness.examine(out).verdict.complete


def test_an_index_whose_shards_are_still_coming_is_not_stale(tmp_path):
    """An index written before its shards (another writer's order), next to an older
    unsharded file: waiting for the shards, not a stale index."""
    out = tmp_path / "model_step_1"
    tiny_qwen(1).save_pretrained(out)
    time.sleep(0.01)
    src = tmp_path / "sharded"
    tiny_qwen(2).save_pretrained(src, max_shard_size=SHARDED)
    index = (src / "model.safetensors.index.json").read_bytes()
    (out / "model.safetensors.index.json").write_bytes(index)
    assert_not_complete(out)


# -- torch DCP without collectives ----------------------------------------------------------

def dcp_local(out: Path, **state: torch.Tensor) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.async_save(state or {"w": torch.randn(64, 64)}, checkpoint_id=str(out), use_collectives=False).result()


def test_dcp_async_save_without_collectives_is_a_complete_checkpoint(db, tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    out = run / "dcp_step_5"
    dcp_local(out)
    assert sorted(p.name for p in out.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    w, sent = make_watcher(db)
    w.scan()
    w.scan()
    ckpt = current(db, out)
    assert ckpt is not None and ckpt.layout == "torch-dcp"
    assert [x.actor for x in sent] == ["shard"]
    with session_scope(db.db_url) as s:
        assert not s.scalars(select(DetectionProblem)).all()
        assert not s.scalars(select(CheckpointPart)).all(), "a save without collectives is not a part"


def test_dcp_ranks_without_collectives_are_complete_only_with_every_ranks_metadata(tmp_path):
    from tests.writers.write import dcp

    (out,) = [Path(p) for p in dcp(tmp_path, 2, collectives=False)]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
    assert completeness.examine(out).verdict.complete
    data = (out / "__1_0.distcp").read_bytes()
    (out / "__1_0.distcp").write_bytes(data[: len(data) // 2])  # rank 1 still writing its data
    v = completeness.examine(out).verdict
    assert not v.complete and "__1.metadata" in v.reason and "host" not in v.reason, v
    meta = (out / "__1.metadata").read_bytes()
    (out / "__1.metadata").unlink()  # rank 1's data written, its metadata not yet
    (out / "__1_0.distcp").write_bytes(data)
    v = completeness.examine(out).verdict
    assert not v.complete and "__1.metadata" in v.reason and "host" not in v.reason, v
    (out / "__1.metadata").write_bytes(meta)
    assert completeness.examine(out).verdict.complete


def test_a_dcp_save_without_collectives_in_progress_blames_no_other_host(db, tmp_path):
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    out = run / "dcp_step_5"
    dcp_local(out / "_", a=torch.randn(8, 8))
    (out / "_" / "__0.metadata").rename(out / "__0.metadata")
    (out / "_" / "__0_0.distcp").rename(out / "__0_0.distcp")
    (out / "_").rmdir()
    (out / "__3_0.distcp").write_bytes(b"x" * 100)  # another rank of this host, its metadata not yet
    import dataclasses

    w, sent = make_watcher(dataclasses.replace(db, quiet_seconds=0.0))
    for _ in range(3):
        w.scan()
    assert sent == []
    with session_scope(db.db_url) as s:
        (problem,) = s.scalars(select(DetectionProblem)).all()
        assert not s.scalars(select(CheckpointPart)).all()
    assert "__3.metadata" in problem.reason and "host" not in problem.reason, problem.reason
