"""Bad input gets a clear error naming what is wrong, and nothing is half-stored."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.integration


def test_store_outside_the_roots_is_refused(shared_cluster, tmp_path):
    p = tmp_path / "elsewhere.safetensors"
    save_file({"a": torch.zeros(3)}, str(p))
    r = shared_cluster.cli("store", str(p))
    assert r.returncode == 1
    assert "is not a checkpoint inside a watched root" in r.stderr


def test_store_of_a_malformed_safetensors_names_the_problem(shared_cluster):
    run = shared_cluster.runs / "run-bad"
    run.mkdir()
    p = run / ".writing"
    save_file({"a": torch.zeros(1000)}, str(p))
    data = p.read_bytes()
    p.unlink()
    bad = run / "broken.safetensors"
    bad.write_bytes(data[:-100])
    r = shared_cluster.cli("store", str(bad))
    assert r.returncode == 1
    assert "broken.safetensors: checkpoint is not complete" in r.stderr and "truncated" in r.stderr
    status = json.loads(shared_cluster.cli("status", "--json").stdout)
    assert str(bad) not in [c["path"] for c in status["checkpoints"]]


def test_restore_of_an_unknown_checkpoint_says_so(shared_cluster, tmp_path):
    r = shared_cluster.cli("restore", "999999", "--to", str(tmp_path / "x"))
    assert r.returncode == 1 and "no checkpoint '999999'" in r.stderr


def test_restore_refuses_to_overwrite_an_existing_destination(shared_cluster, tmp_path):
    run = shared_cluster.runs / "run-overwrite"
    run.mkdir()
    p = run / "m.safetensors"
    save_file({"a": torch.ones(10)}, str(p))
    r = shared_cluster.cli("store", str(p), "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    dest = tmp_path / "exists"
    dest.write_text("keep me")
    r = shared_cluster.cli("restore", str(p), "--to", str(dest))
    assert r.returncode == 1 and "already exists" in r.stderr
    assert dest.read_text() == "keep me"


def test_store_of_an_incomplete_directory_says_what_is_missing(shared_cluster):
    import os

    from tests.checkpoints import dcp_folder

    run = shared_cluster.runs / "run-incomplete"
    run.mkdir()
    d = dcp_folder(run / "step_9")
    os.unlink(d / ".metadata")
    r = shared_cluster.cli("store", str(d))
    assert r.returncode == 1
    assert ("step_9: checkpoint is not complete: torch DCP data files (*.distcp) without metadata: neither the "
            ".metadata") in r.stderr


def test_restore_never_writes_through_a_symlink_planted_at_its_staging_path(shared_cluster, tmp_path):
    """The staging name is predictable (``.DEST.ckpt-restore-JOB.ATTEMPT``): a dangling symlink
    planted there must not receive the restored bytes; the restore still succeeds."""
    from sqlalchemy import func, select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import Job

    run = shared_cluster.runs / "run-symlink"
    run.mkdir()
    p = run / "m.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(p))
    r = shared_cluster.cli("store", str(p), "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    with session_scope(shared_cluster.settings.db_url) as s:
        last = s.scalar(select(func.max(Job.id))) or 0
    dest = tmp_path / "restored.safetensors"
    victims = []
    for job_id in range(last + 1, last + 20):
        for attempt in range(1, 4):
            victim = tmp_path / f"victim-{job_id}-{attempt}"
            (tmp_path / f".{dest.name}.ckpt-restore-{job_id}.{attempt}").symlink_to(victim)
            victims.append(victim)
    r = shared_cluster.cli("restore", str(p), "--to", str(dest), "--wait")
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == p.read_bytes() and not dest.is_symlink()
    assert not [v for v in victims if v.exists()]
