"""Crashes delay work but never lose it, and never lose data."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import func, select

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, Shard
from pipeline.detection.catalog import resolve
from pipeline.restoring.gather import manifest
from pipeline.restoring.loader import load_state_dict
from tests.checkpoints import atomic_save, files_of, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration


def big_checkpoint(path, seed: int = 0):
    """~40 MB in ~160 shards of 256 KiB (the test cluster's shard size): many transfers."""
    return atomic_save(state_dict(seed, layers=24, width=256), path)


def of_checkpoint(cid: int):
    return select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == cid)


def stored_copies(cluster, job_id: int) -> int:
    """Copies uploaded so far (each is re-hashed and marked verified as soon as it is stored)."""
    with session_scope(cluster.settings.db_url) as s:
        cid = cluster.job(job_id).checkpoint_id
        return s.scalar(select(func.count(ContentCopy.id))
                        .where(ContentCopy.sha256.in_(of_checkpoint(cid)),
                               ContentCopy.state.in_(("stored", "verified"))))


def node_id(worker) -> str:
    return (worker.data / "node_id").read_text().strip()


def test_storage_worker_killed_during_store_then_restore_falls_back(make_cluster, tmp_path):
    cluster = make_cluster()
    run = cluster.runs / "run"
    run.mkdir()
    path = big_checkpoint(run / "step_1.safetensors")
    original = files_of(path)
    job_id = checkpoint_job(cluster, path)
    wait_for(lambda: stored_copies(cluster, job_id) >= 5, 60, "some copies stored")
    dead = cluster.workers[0]
    dead.kill()

    cluster.wait_job(job_id, ("verified",), timeout=120)
    with session_scope(cluster.settings.db_url) as s:
        cid = cluster.job(job_id).checkpoint_id
        live = s.scalars(select(ContentCopy).where(ContentCopy.sha256.in_(of_checkpoint(cid)),
                                                   ContentCopy.state == "verified")).all()
        assert {r.worker_id for r in live}.isdisjoint({node_id(dead)})

    # Now lose a second worker: every shard still has its copy on the third, and gathering
    # must fall back to it for the shards whose preferred replica was on the lost worker.
    second = cluster.workers[1]
    with session_scope(cluster.settings.db_url) as s:
        files = manifest(s, resolve(s, str(path)))
    preferred_on_second = sum(1 for f in files for sh in f.shards if sh.copies[0][0] == node_id(second))
    assert preferred_on_second > 0
    second.kill()
    loaded = load_state_dict(str(path), cluster.settings)  # manifest still prefers the dead worker here
    ref = load_file(str(path))
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)

    dest = tmp_path / "restored.safetensors"
    r = cluster.cli("restore", str(path), "--to", str(dest), "--wait", timeout=180)
    assert r.returncode == 0, r.stderr + cluster.logs()
    assert files_of(dest) == original
