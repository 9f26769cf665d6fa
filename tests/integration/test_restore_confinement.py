"""Restore confinement with the real system: ``--overwrite`` gives a protected checkpoint back at
its own path byte for byte; the restore actor (a real dramatiq worker) checks the destination
again when it writes, not only when it was asked; a staging directory swapped for a symlink
while it is written makes the restore fail, writing nothing through the link."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker

from pipeline.db.engine import session_scope
from pipeline.restoring import job as restore_job
from tests.checkpoints import atomic_save, files_of, hf_folder, state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration


def _protected(cluster, path: Path) -> Path:
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    settled = time.time() - 60  # saved longer ago than the settle time: no writer is at it
    for p in [path, *path.rglob("*")]:
        os.utime(p, (settled, settled), follow_symlinks=False)
    return path


def _request(cluster, path: Path, dest: Path, *, overwrite: bool) -> int:
    with session_scope(cluster.settings.db_url) as s:
        return restore_job.request(s, cluster.settings, str(path), str(dest), overwrite=overwrite).id


def _send_restore(cluster, job_id: int) -> None:
    """Enqueue the restore message as `ckpt restore` does, for the cluster's dramatiq workers."""
    broker = RedisBroker(url=f"unix://{cluster.settings.redis_socket}")
    try:
        broker.enqueue(Message(queue_name="ckpt", actor_name="restore", args=(job_id,), kwargs={}, options={}))
    finally:
        broker.close()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_overwrite_gives_a_protected_checkpoint_back_at_its_own_path(shared_cluster, kind):
    """Unchanged on disk: replaced by the restored files. Deleted: restored where it was."""
    run = shared_cluster.runs / f"run-overwrite-own-{kind}"
    run.mkdir()
    path = (atomic_save(state_dict(21, layers=6, width=96), run / "step_21.safetensors") if kind == "file"
            else hf_folder(run / "checkpoint-21", seed=21))
    original = files_of(_protected(shared_cluster, path))
    r = shared_cluster.cli("restore", str(path), "--to", str(path), "--overwrite", "--wait")
    assert r.returncode == 0, r.stderr
    assert files_of(path) == original
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no staging or set-aside left

    if kind == "file":
        path.unlink()
    else:
        for p in sorted(path.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        path.rmdir()
    r = shared_cluster.cli("restore", str(path), "--to", str(path), "--wait")
    assert r.returncode == 0, r.stderr
    assert files_of(path) == original


@pytest.mark.parametrize("what", ["run", "root", "being-written", "outside"])
def test_overwrite_refusals_through_the_cli_touch_nothing(shared_cluster, tmp_path_factory, what):
    run = shared_cluster.runs / f"run-refuse-{what}"
    run.mkdir()
    path = _protected(shared_cluster, atomic_save(state_dict(22), run / "step_22.safetensors"))
    keep = [path]
    env = dict(shared_cluster.env)
    if what == "run":
        dest, said = run, "never removes a run"
    elif what == "root":  # (another test's run still being stored would be named first)
        dest, said = shared_cluster.runs, "never removes a root|not protected yet"
    elif what == "being-written":
        dest, said = run / "checkpoint-23", "not a protected checkpoint's content"
        dest.mkdir()
        (dest / "model.safetensors").write_bytes(os.urandom(4096))  # a save under way: its only copy
        settled = time.time() - 60  # this refusal, not the one of a file written a moment ago
        for p in (dest / "model.safetensors", dest):
            os.utime(p, (settled, settled))
        keep.append(dest / "model.safetensors")
    else:  # a home-like directory above the watched root: outside the default restore roots
        dest, said = tmp_path_factory.mktemp("home-like"), "outside the restore roots"
        (dest / "notes").write_text("mine")
        keep.append(dest / "notes")
        env["CKPT_RESTORE_ROOTS"] = ""
    before = {p: p.read_bytes() for p in keep}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "restore", str(path), "--to", str(dest),
                        "--overwrite", "--wait"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and re.search(said, r.stderr), r.stderr
    assert {p: p.read_bytes() for p in keep} == before


def test_the_actor_checks_the_destination_again_when_it_writes(shared_cluster):
    """Asked while the path held the protected bytes; by the time the actor runs the trainer
    has saved again at that path: the actor refuses, the new save stays as written."""
    run = shared_cluster.runs / "run-recheck"
    run.mkdir()
    path = _protected(shared_cluster, atomic_save(state_dict(24), run / "step_24.safetensors"))
    job_id = _request(shared_cluster, path, path, overwrite=True)  # accepted: unchanged on disk
    atomic_save(state_dict(99), path)  # the trainer saves again, in place (and it settles)
    os.utime(path, (time.time() - 60, time.time() - 60))
    new = path.read_bytes()
    _send_restore(shared_cluster, job_id)
    job = shared_cluster.wait_job(job_id, ("failed",))
    assert "refused" in job.last_error and ("not a protected checkpoint's content" in job.last_error
                                            or "not protected yet" in job.last_error
                                            or "changed since the restore was asked" in job.last_error), job.last_error
    assert path.read_bytes() == new
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_a_staging_directory_swapped_for_a_symlink_receives_nothing(shared_cluster, tmp_path, monkeypatch):
    """The staging directory is swapped for a link to another directory after the restore made
    it and before it writes: the files go to the directory it opened (never through the link),
    the restore fails, nothing is put in place. The actor step runs here so that the swap
    happens at that exact point; the storage workers and the control plane are the real ones."""
    run = shared_cluster.runs / "run-swap"
    run.mkdir()
    path = _protected(shared_cluster, hf_folder(run / "checkpoint-25", seed=25))
    dest, victim, moved = tmp_path / "restored", tmp_path / "victim", tmp_path / "moved"
    victim.mkdir()
    job_id = _request(shared_cluster, path, dest, overwrite=False)
    staging = tmp_path / f".restored.ckpt-restore-{job_id}.1"
    real, swapped = restore_job.write_file, []

    def swap_then_write(*args, **kwargs):
        if not swapped:
            os.rename(staging, moved)
            staging.symlink_to(victim)
            swapped.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_job, "write_file", swap_then_write)
    assert restore_job.restore(shared_cluster.settings, job_id) == []
    job = shared_cluster.job(job_id)
    assert swapped and job.state == "failed" and "was replaced while the restore wrote it" in job.last_error
    assert list(victim.iterdir()) == []
    assert not os.path.lexists(dest)
    assert staging.is_symlink()  # not ours: left alone, never followed
    assert sorted(p.name for p in moved.rglob("*") if p.is_file()) == sorted(files_of(path))
