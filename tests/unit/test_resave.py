"""Saved again at the same path (docs/design.md, "The current version of a path is what is on
disk now"): a new save written over a recorded version is not taken for complete while the old
version's last file is still the old one, and the path says loudly that it changed."""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.core.layouts import Entry, FileFacts, FileFormat, resave_in_progress
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import transition
from pipeline.detection import catalog, completeness
from pipeline.detection.ondisk import differs
from pipeline.detection.watcher import Watcher
from pipeline.errors import RestoreError
from pipeline.restoring import job as restore_job
from pipeline.status import checkpoint_rows, run_facts
from tests.checkpoints import dcp_folder, hf_folder
from tests.unit.test_layouts_resave import SHARDED, interrupted_save
from tests.writers.write import tiny_qwen


def facts(rel: str, size: int, ns: int, fmt: str = FileFormat.OTHER, names: tuple[str, ...] = ()) -> FileFacts:
    return FileFacts(rel, size, ns, fmt, names=names)


def recorded(entry: Entry) -> dict[str, tuple[int, int]]:
    return {f.relpath: (f.size, f.mtime_ns) for f in entry.files}


def test_a_trainer_folder_saved_again_waits_for_its_new_trainer_state():
    old = Entry("checkpoint-4", True, (facts("model.safetensors", 10, 1), facts("trainer_state.json", 5, 2)))
    half = Entry("checkpoint-4", True, (facts("model.safetensors", 12, 3), facts("trainer_state.json", 5, 2)))
    done = Entry("checkpoint-4", True, (facts("model.safetensors", 12, 3), facts("trainer_state.json", 6, 4)))
    assert resave_in_progress(old, recorded(old)) is None  # nothing changed
    why = resave_in_progress(half, recorded(old))
    assert why is not None and "model.safetensors changed" in why and "trainer_state.json" in why
    assert resave_in_progress(done, recorded(old)) is None
    assert resave_in_progress(half, {}) is None  # nothing recorded there: the layout rule decides


def test_dcp_rank_files_rewritten_under_the_old_metadata_are_in_progress():
    meta = facts(".metadata", 100, 1, FileFormat.DCP_METADATA, names=("__0_0.distcp",))
    old = Entry("step_2", True, (meta, facts("__0_0.distcp", 50, 1)))
    half = Entry("step_2", True, (meta, facts("__0_0.distcp", 50, 9)))
    assert "writes last" in resave_in_progress(half, recorded(old))
    new_meta = facts(".metadata", 100, 10, FileFormat.DCP_METADATA, names=("__0_0.distcp",))
    assert resave_in_progress(Entry("step_2", True, (new_meta, facts("__0_0.distcp", 50, 9))), recorded(old)) is None


def test_a_stale_index_is_not_the_last_file_of_an_unsharded_save_over_a_sharded_one():
    index = facts("model.safetensors.index.json", 30, 1, FileFormat.JSON,
                  names=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    old = Entry("final", True, (facts("config.json", 3, 1), index,
                                facts("model-00001-of-00002.safetensors", 10, 1),
                                facts("model-00002-of-00002.safetensors", 10, 1)))
    # transformers deletes the old shards but leaves the index: the new save is complete.
    new = Entry("final", True, (facts("config.json", 3, 5), index, facts("model.safetensors", 20, 5)))
    assert resave_in_progress(new, recorded(old)) is None
    # Sharded again, the index still the old one while the shards are rewritten: in progress.
    half = Entry("final", True, (facts("config.json", 3, 5), index,
                                 facts("model-00001-of-00002.safetensors", 10, 6),
                                 facts("model-00002-of-00002.safetensors", 10, 6)))
    assert "index.json" in resave_in_progress(half, recorded(old))


def test_a_save_pretrained_folder_whose_config_changed_waits_for_its_new_weights():
    old = Entry("final", True, (facts("config.json", 3, 1, FileFormat.JSON), facts("model.safetensors", 10, 1)))
    half = Entry("final", True, (facts("config.json", 4, 5, FileFormat.JSON), facts("model.safetensors", 10, 1)))
    why = resave_in_progress(half, recorded(old))
    assert why is not None and "config.json changed" in why and "model.safetensors" in why
    done = Entry("final", True, (facts("config.json", 4, 5, FileFormat.JSON), facts("model.safetensors", 12, 6)))
    assert resave_in_progress(done, recorded(old)) is None
    # Recorded before its tokenizer came (a pause longer than the settle time): files only added
    # beside an unchanged config and weights are the rest of that save, not a new one half written.
    grown = Entry("final", True, (*old.files, facts("tokenizer.json", 7, 8, FileFormat.JSON)))
    assert resave_in_progress(grown, recorded(old)) is None


def test_a_save_model_folder_waits_for_its_training_args_which_save_model_writes_last():
    files = (facts("config.json", 3, 1, FileFormat.JSON), facts("model.safetensors", 10, 1),
             facts("training_args.bin", 5, 2, FileFormat.TORCH_ZIP))
    old = Entry("final", True, files)
    half = Entry("final", True, (facts("config.json", 3, 5, FileFormat.JSON), facts("model.safetensors", 12, 6),
                                 files[2]))
    assert "training_args.bin" in resave_in_progress(half, recorded(old))
    done = Entry("final", True, (*half.files[:2], facts("training_args.bin", 5, 7, FileFormat.TORCH_ZIP)))
    assert resave_in_progress(done, recorded(old)) is None
    # Recorded early, without it: training_args.bin coming is that save ending.
    early = Entry("final", True, files[:2])
    assert resave_in_progress(old, recorded(early)) is None


def test_a_single_file_has_no_last_file_rule():
    old = Entry("step_1.safetensors", False, (facts("", 10, 1, FileFormat.SAFETENSORS),))
    assert resave_in_progress(Entry("step_1.safetensors", False, (facts("", 12, 2, FileFormat.SAFETENSORS),)),
                              recorded(old)) is None


# -- the watcher, with real writers ----------------------------------------------------------

def _protect(db, path: Path) -> Checkpoint:
    """The current version at ``path``, its store job taken to verified (copies are not what
    these tests are about)."""
    with session_scope(db.db_url) as s:
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        job = catalog.latest_store_job(s, ckpt.id)
        for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")]:
            transition(s, job.id, "store", a, b)
        s.expunge(ckpt)
        return ckpt


def _current(db, path: Path) -> Checkpoint:
    with session_scope(db.db_url) as s:
        c = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        s.expunge(c)
        return c


def test_a_resave_killed_halfway_is_flagged_and_a_restore_by_path_refuses(db, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "r"
    run.mkdir()
    out = run / "final"
    tiny_qwen(1).save_pretrained(out, max_shard_size=SHARDED)
    w = Watcher(db, [].extend, use_events=False)
    w.scan()
    v1 = _protect(db, out)
    time.sleep(0.01)
    # The trainer saves again into the same folder and is killed after its first shard: the
    # old index and the other old shards make the folder look complete.
    interrupted_save(tiny_qwen(2), out, monkeypatch, after=1, max_shard_size=SHARDED)
    # By the layout table alone it would be taken once quiet (a shard is newer than the index).
    assert completeness.examine(out).verdict.kind == "quiet"
    quiet = dataclasses.replace(db, quiet_seconds=0.0)
    for _restart in range(2):  # a watcher that starts now, and again after a restart
        watcher = Watcher(quiet, [].extend, use_events=False)
        watcher.reconcile()
        watcher.scan()
        now_ = _current(db, out)
        assert now_.id == v1.id, "a half-written re-save was recorded as a version"
        assert now_.disk_changed and "model.safetensors.index.json" in now_.disk_changed, now_.disk_changed
    with session_scope(db.db_url) as s:
        (row,) = checkpoint_rows(s, db, [s.get(Checkpoint, v1.id)])
        assert row["disk_changed"] and row["disk_changed_at"] is not None
        assert run_facts(s)[str(run)]["changed_on_disk"] == 1
        with pytest.raises(RestoreError, match=f"changed on disk.*ckpt restore {v1.id} --to"):
            restore_job.validate(s, db, str(out), str(run / "restored"))
        assert restore_job.validate(s, db, str(v1.id), str(run / "restored"))[0].id == v1.id  # by id: as asked

    time.sleep(0.01)
    tiny_qwen(2).save_pretrained(out, max_shard_size=SHARDED)  # the save done again, to the end
    w.scan()
    v2 = _current(db, out)
    assert v2.id != v1.id and v2.disk_changed is None
    with session_scope(db.db_url) as s:
        assert catalog.latest_store_job(s, v1.id).state == "superseded"
        assert run_facts(s)[str(run)]["changed_on_disk"] == 0


def _recorded(db, tmp_path, write) -> tuple[Path, Watcher, Checkpoint]:
    """A checkpoint written by ``write(run)``, recorded by a watcher and protected."""
    run = tmp_path / "runs" / "r"
    run.mkdir()
    path = write(run)
    w = Watcher(db, [].extend, use_events=False)
    w.scan()
    return path, w, _protect(db, path)


def test_dcp_rank_files_saved_again_under_the_old_metadata_wait(db, tmp_path):
    step, w, v1 = _recorded(db, tmp_path, lambda run: dcp_folder(run / "step_2", seed=1))
    # A restart saves step 2 again: the rank file first, .metadata last (not yet).
    new = dcp_folder(tmp_path / "elsewhere" / "step_2", seed=2)
    time.sleep(0.01)
    shutil.copyfile(new / "__0_0.distcp", step / "__0_0.distcp")
    assert completeness.examine(step).verdict.complete  # the old .metadata makes it look done
    w.scan()
    assert _current(db, step).id == v1.id and ".metadata" in _current(db, step).disk_changed
    shutil.copyfile(new / ".metadata", step / ".metadata")
    w.scan()
    assert _current(db, step).id != v1.id and _current(db, step).disk_changed is None


def test_files_touched_without_new_bytes_keep_their_version_and_do_not_block_rotation(db, tmp_path):
    out, w, v1 = _recorded(db, tmp_path, lambda run: hf_folder(run / "checkpoint-5", seed=5))
    time.sleep(0.05)
    later = time.time()
    for p in out.rglob("*"):
        os.utime(p, (later, later))
    w.scan()
    c = _current(db, out)
    assert c.id == v1.id and c.disk_changed is None and c.mtime == v1.mtime  # a touch is not a new save
    with session_scope(db.db_url) as s:
        ckpt = s.get(Checkpoint, v1.id)
        assert differs(Path(ckpt.path), True, catalog.own_files(ckpt)) is None


def test_a_sharded_save_side_by_side_in_the_run_saved_again_waits_for_its_new_index(db, tmp_path, monkeypatch):
    """``save_pretrained(run, max_shard_size=...)``: each shard and the index are checkpoints of
    their own, one save group. Saved again and killed after its first shard, nothing of the
    first save is replaced; saved again to the end, every file's new version is recorded."""
    run = tmp_path / "runs" / "r"
    run.mkdir()
    tiny_qwen(1).save_pretrained(run, max_shard_size=SHARDED)
    names = sorted(p.name for p in run.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "config.json"
                   and p.name != "generation_config.json")
    assert len(names) >= 3 and names[-1] == "model.safetensors.index.json", names
    w = Watcher(db, [].extend, use_events=False)
    w.scan()
    v1 = {n: _protect(db, run / n).id for n in names}
    time.sleep(0.01)
    interrupted_save(tiny_qwen(2), run, monkeypatch, after=1, max_shard_size=SHARDED)
    w.scan()
    first = _current(db, run / names[0])
    assert first.id == v1[names[0]], "the first shard of a save killed after it replaced the recorded one"
    assert "model.safetensors.index.json" in (first.disk_changed or ""), first.disk_changed
    time.sleep(0.01)
    tiny_qwen(2).save_pretrained(run, max_shard_size=SHARDED)  # the save done again, to the end
    w.scan()
    w.scan()  # the shards looked at again once the index is recorded
    same = [n for n in names if _current(db, run / n).id == v1[n]]
    assert same == ["model.safetensors.index.json"], same  # the same bytes (the same names and sizes): touched
