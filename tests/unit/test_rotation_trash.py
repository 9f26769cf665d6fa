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
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import transition
from pipeline.detection import catalog
from pipeline.detection.watcher import Watcher
from pipeline.store import rotation, trash
from tests.checkpoints import atomic_save, hf_folder, state_dict


def _protect(settings, path: Path) -> int:
    with session_scope(settings.db_url) as s:
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path), Checkpoint.current.is_(True)))
        job = catalog.latest_store_job(s, ckpt.id)
        for a, b in [("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")]:
            transition(s, job.id, "store", a, b)
        return job.id


@pytest.mark.parametrize("how", ["crash right after the rename", "a folder checkpoint replaced by a file"])
def test_a_new_save_moved_by_the_rename_is_never_deleted(db, tmp_path, monkeypatch, how):
    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    folder = how.startswith("a folder")
    path = run / ("checkpoint-1" if folder else "step_1.safetensors")
    hf_folder(path, seed=1) if folder else atomic_save(state_dict(1), path)
    Watcher(settings, [].extend, use_events=False).scan()
    job_id = _protect(settings, path)
    monkeypatch.setattr(rotation, "confirm_with_workers", lambda *a: None)   # copies confirmed
    monkeypatch.setattr(rotation, "unsafe_reason", lambda *a: None)          # invariant 1 holds
    cid = _ckpt_id(settings, path)
    monkeypatch.setattr(rotation, "rotation_candidates", lambda *a: [cid])
    time.sleep(0.02)
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


def _ckpt_id(settings, path):
    with session_scope(settings.db_url) as s:
        return s.scalar(select(Checkpoint.id).where(Checkpoint.path == str(path)))


def test_a_trash_entry_written_to_after_a_crash_past_the_commit_is_never_deleted(db, tmp_path, monkeypatch):
    """The process dies after the commit, before the re-check that comes before the delete: the
    next pass that empties the trash checks the entry itself and puts it back."""
    settings = dataclasses.replace(db, quiet_seconds=0.0)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    path = run / "step_1.safetensors"
    atomic_save(state_dict(1), path)
    Watcher(settings, [].extend, use_events=False).scan()
    job_id = _protect(settings, path)
    cid = _ckpt_id(settings, path)
    monkeypatch.setattr(rotation, "confirm_with_workers", lambda *a: None)
    monkeypatch.setattr(rotation, "unsafe_reason", lambda *a: None)
    monkeypatch.setattr(rotation, "rotation_candidates", lambda *a: [cid])
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


def test_without_hard_links_an_entry_goes_beside_the_path_never_over_it(tmp_path, monkeypatch):
    path = tmp_path / "step_7.safetensors"
    path.write_bytes(b"old")
    entry = trash.move_to_trash(path)

    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    back = trash.restore(entry, path)  # nothing at the path, yet no check-then-rename race either
    assert back.name.startswith("step_7.kept-") and back.read_bytes() == b"old" and not trash.entries(tmp_path)


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
