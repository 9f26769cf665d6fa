"""Rotation's trash never deletes a save it did not store: a crash between the rename and the
re-check, a folder replaced by a file, a write through a held file after a crash past the commit
(found by the outside attack on the race fix; pipeline.store.rotation, docs/design.md invariant 1)."""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointPart
from pipeline.detection import catalog
from pipeline.detection.watcher import Watcher
from pipeline.store import rotation, trash
from tests.checkpoints import atomic_save, dcp_folder, hf_folder, state_dict
from tests.unit.test_attack_i27 import _protect
from tests.unit.test_parts import _announce_b, _split_step, _watcher, rotated


def _store_job(settings, checkpoint_id: int) -> int:
    with session_scope(settings.db_url) as s:
        return catalog.latest_store_job(s, checkpoint_id).id


def _rotatable(db, tmp_path, monkeypatch, folder: bool = False):
    """One checkpoint recorded and verified, which rotation may delete (its copies confirmed):
    ``(settings, run, path, job_id)``."""
    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    path = run / ("checkpoint-1" if folder else "step_1.safetensors")
    hf_folder(path, seed=1) if folder else atomic_save(state_dict(1), path)
    Watcher(settings, [].extend, use_events=False).scan()
    cid = _protect(settings, path)  # its store job verified
    job_id = _store_job(settings, cid)
    monkeypatch.setattr(rotation, "confirm_with_workers", lambda *a: None)   # copies confirmed
    monkeypatch.setattr(rotation, "unsafe_reason", lambda *a: None)          # invariant 1 holds
    monkeypatch.setattr(rotation, "rotation_candidates", lambda *a: [cid])
    time.sleep(0.02)
    return settings, run, path, job_id


@pytest.mark.parametrize("how", ["crash right after the rename", "a folder checkpoint replaced by a file"])
def test_a_new_save_moved_by_the_rename_is_never_deleted(db, tmp_path, monkeypatch, how):
    folder = how.startswith("a folder")
    settings, run, path, job_id = _rotatable(db, tmp_path, monkeypatch, folder)
    new = tmp_path / "new.tmp"
    atomic_save(state_dict(99), new)
    new_bytes = new.read_bytes()
    real = rotation.move_to_trash

    def race(p, inside=None):  # between rotation's check and its rename, the trainer saves
        if folder:
            shutil.rmtree(p)
        os.rename(new, p)
        entry = real(p, inside=inside)
        if not folder:
            raise SystemExit("killed right after the rename")  # a crash before the re-check
        return entry

    monkeypatch.setattr(rotation, "move_to_trash", race)
    if folder:  # the re-check sees a file where a folder was stored: put back, rotation blocked
        rotation.rotate(settings, job_id)
    else:
        with pytest.raises(SystemExit):
            rotation.rotate(settings, job_id)
    monkeypatch.setattr(rotation, "move_to_trash", real)
    rotation.rotate(settings, job_id)  # the message again (or the next rotation of the run)
    rotation.plan_run(settings, str(run))  # empties the trash of rotations that committed
    kept = [p for p in run.iterdir() if p.is_file() and p.read_bytes() == new_bytes]
    assert kept, f"the new save was deleted; left in {run}: {sorted(os.listdir(run))}"


def test_a_trash_entry_written_to_after_a_crash_past_the_commit_is_never_deleted(db, tmp_path, monkeypatch):
    """The process dies after the commit, before the re-check that comes before the delete: the
    next pass that empties the trash checks the entry itself and puts it back."""
    settings, run, path, job_id = _rotatable(db, tmp_path, monkeypatch)
    f = open(path, "r+b")  # a writer holding the file open

    def crash(*a):
        raise SystemExit("killed after the commit, before the re-check")

    monkeypatch.setattr(rotation, "_remove_if_unchanged", crash)
    with pytest.raises(SystemExit):
        rotation.rotate(settings, job_id)
    time.sleep(0.02)
    f.seek(-1000, os.SEEK_END)
    f.write(os.urandom(1000))  # bytes no replica has, written while the pipeline restarts
    f.flush()
    f.seek(0)
    new_bytes = f.read()
    f.close()
    rotation.plan_run(settings, str(run))
    kept = [p for p in run.iterdir() if p.is_file() and p.read_bytes() == new_bytes]
    assert kept, f"the written-to entry was deleted; left in {run}: {sorted(os.listdir(run))}"


@pytest.mark.parametrize("renameat2", [True, False])
def test_a_file_the_service_may_not_link_goes_back_by_rename_or_beside_never_over_the_path(tmp_path, monkeypatch,
                                                                                          renameat2):
    """Hard links refused (fs.protected_hardlinks, another user's file; or none on the
    filesystem): the kernel's no-replace rename puts the entry back at its path; without it, the
    entry goes beside the path, never renamed onto it after a check."""
    path = tmp_path / "step_7.safetensors"
    path.write_bytes(b"old")
    entry = trash.move_to_trash(path)

    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    if not renameat2:
        monkeypatch.setattr(trash, "_renameat2", lambda: None)
    back = trash.restore(entry, path)
    assert back.read_bytes() == b"old" and not trash.entries(tmp_path)
    assert back == path if renameat2 else back.name.startswith("step_7.kept-")


def test_a_committed_rotations_entry_written_to_before_its_delete_goes_back(tmp_path):
    """The re-check right before the delete: bytes written through a held file since the
    decision are not what was stored."""
    path = tmp_path / "step_1.safetensors"
    atomic_save(state_dict(1), path)
    st = path.stat()
    files = [rotation._Kept("", st.st_size, st.st_mtime_ns, "")]
    entry = trash.move_to_trash(path)
    time.sleep(0.02)
    with open(entry, "r+b") as f:
        f.seek(-1000, os.SEEK_END)
        f.write(os.urandom(1000))
    written = Path(entry).read_bytes()
    rotation._remove_if_unchanged(1, entry, str(path), tmp_path, False, files)
    assert path.read_bytes() == written and not trash.entries(tmp_path)
    # Unchanged, it is deleted.
    st = path.stat()
    entry = trash.move_to_trash(path)
    rotation._remove_if_unchanged(1, entry, str(path), tmp_path, False,
                                  [rotation._Kept("", st.st_size, st.st_mtime_ns, "")])
    assert not path.exists() and not trash.entries(tmp_path)


def test_a_new_save_a_crash_left_in_the_trash_comes_back_when_the_watcher_saw_the_gap_first(db, tmp_path,
                                                                                           monkeypatch):
    settings, run, path, job_id = _rotatable(db, tmp_path, monkeypatch)
    new = tmp_path / "new.tmp"
    atomic_save(state_dict(99), new)
    new_bytes = new.read_bytes()
    real = rotation.move_to_trash

    def race(p, inside=None):
        os.rename(new, p)
        real(p, inside=inside)
        raise SystemExit("killed right after the rename")

    monkeypatch.setattr(rotation, "move_to_trash", race)
    with pytest.raises(SystemExit):
        rotation.rotate(settings, job_id)
    monkeypatch.setattr(rotation, "move_to_trash", real)
    w = Watcher(settings, [].extend, use_events=False)   # the watcher restarts / scans first
    w.reconcile()
    w.scan()
    rotation.rotate(settings, job_id)        # the message redelivered
    for _ in range(3):
        rotation.plan_run(settings, str(run))
        w.scan()
    visible = [p for p in run.iterdir() if not p.name.startswith(".") and p.is_file() and p.read_bytes() == new_bytes]
    assert visible, f"new save never stored, hidden in the trash: {sorted(os.listdir(run))}"
    assert not trash.entries(run)


# A multi-host part (tests/unit/test_parts.py): node-b holds its rank's files of step_1.
def _rotated_on_a(db, tmp_path):
    (tmp_path / "runs" / "r").mkdir(parents=True)
    step, b_dir = _split_step(db, tmp_path)
    _announce_b(db, step, b_dir)
    assert _watcher(db, "node-a").consider(step.parent, step) is None
    shutil.rmtree(step)
    shutil.copytree(b_dir, step, copy_function=shutil.copy2)
    with session_scope(db.db_url) as s:
        rotated(s)
    return step, b_dir


def test_a_rotated_parts_leftover_is_removed_though_the_host_saved_the_step_again(db, tmp_path):
    step, b_dir = _rotated_on_a(db, tmp_path)
    # node-b's rotate_part committed (part gone), then the process died before its delete
    entry = trash.move_to_trash(step)
    with session_scope(db.db_url) as s:
        s.scalar(select(CheckpointPart)).local_present = False
    # the job restarts and saves step_1 again: node-b's new part announced at the path
    new = dcp_folder(tmp_path / "save-2" / "step_1", seed=9)
    step.mkdir()
    for d in (step, b_dir):
        shutil.copy2(new / "__0_0.distcp", d / "__0_0.distcp")
    _announce_b(db, step, b_dir)
    b = dataclasses.replace(db, host="node-b")
    rotation.plan_run(b, str(step.parent))
    left = sorted(os.listdir(step.parent))
    assert not any(".kept-" in n for n in left), f"stored, rotated leftover put back: {left}"
    assert not os.path.lexists(entry), left


def test_one_undeletable_entry_never_stops_the_rotations_of_its_run(db, tmp_path, monkeypatch):
    step, b_dir = _rotated_on_a(db, tmp_path)
    trash.move_to_trash(step)
    with session_scope(db.db_url) as s:
        s.scalar(select(CheckpointPart)).local_present = False

    def ro(entry, inside=None):  # rmtree of a folder the trainer made read-only (non-root service)
        raise PermissionError(13, "Permission denied", str(entry))
    monkeypatch.setattr(trash, "remove", ro)
    rotation.plan_run(dataclasses.replace(db, host="node-b"), str(step.parent))  # says it, goes on
    assert trash.entries(step.parent)  # and the entry stays
