"""Each kind of checkpoint reaches 'verified' through the real system and comes back byte for byte."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from pipeline.restoring.loader import load_state_dict
from tests.checkpoints import atomic_save, dcp_folder, files_of, hf_folder, state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration

WRITERS = {
    "safetensors-file": lambda run: atomic_save(state_dict(1, layers=8, width=128), run / "model-step100.safetensors"),
    "hf-folder": lambda run: hf_folder(run / "checkpoint-100", seed=2),
    "dcp-folder": lambda run: dcp_folder(run / "step_100", seed=3),
}


@pytest.mark.parametrize("kind", WRITERS)
def test_checkpoint_is_verified_then_restored_byte_identical(shared_cluster, tmp_path, kind):
    run = shared_cluster.runs / f"run-{kind}"
    run.mkdir()
    path = WRITERS[kind](run)
    original = files_of(path)

    job_id = checkpoint_job(shared_cluster, path)
    shared_cluster.wait_job(job_id, ("verified",))

    dest = tmp_path / "restored"
    r = shared_cluster.cli("restore", str(path), "--to", str(dest), "--wait")
    assert r.returncode == 0, r.stderr
    assert files_of(dest) == original


def test_load_state_dict_builds_the_tensors_from_shards(shared_cluster):
    run = shared_cluster.runs / "run-load"
    run.mkdir()
    sd = state_dict(7, layers=6, width=96, dtype=torch.bfloat16)
    path = atomic_save(sd, run / "step_7.safetensors")
    shared_cluster.wait_job(checkpoint_job(shared_cluster, path), ("verified",))
    loaded = load_state_dict(str(path), shared_cluster.settings)
    reference = load_file(str(path))
    assert loaded.keys() == reference.keys()
    for k in reference:
        assert loaded[k].dtype == reference[k].dtype and torch.equal(loaded[k], reference[k]), k


def test_status_json_lists_the_protected_checkpoints(shared_cluster):
    import json

    r = shared_cluster.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    states = {c["path"]: c for c in doc["checkpoints"]}
    assert states and all({"id", "path", "state", "local_present"} <= set(c) for c in states.values())
    assert any(c["state"] == "verified" and c["replicas_verified"] >= 2 for c in states.values())


def test_each_copy_is_rehashed_by_its_worker_as_soon_as_it_is_stored(shared_cluster):
    from sqlalchemy import select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import CheckpointFile, ContentCopy, Job, JobEvent, Shard

    run = shared_cluster.runs / "run-early-verify"
    run.mkdir()
    path = atomic_save(state_dict(11, layers=8, width=128), run / "step_11.safetensors")
    job_id = checkpoint_job(shared_cluster, path)
    shared_cluster.wait_job(job_id, ("verified",))
    with session_scope(shared_cluster.settings.db_url) as s:
        job = s.get(Job, job_id)
        shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == job.checkpoint_id)
        reps = s.scalars(select(ContentCopy).where(ContentCopy.sha256.in_(shas))).all()
        assert len(reps) >= 2 * 3
        assert all(r.state == "verified" and r.verified_at >= r.stored_at for r in reps)
        detail = s.scalar(select(JobEvent.detail).where(JobEvent.job_id == job_id, JobEvent.to_state == "verified"))
        fresh = sum(1 for r in reps if r.stored_at >= job.created_at)
    assert fresh >= 2 * 3
    # Every copy this job stored was re-hashed as it was stored. Content it shares with
    # earlier checkpoints (deduplicated, stored before this job) is re-hashed by its recheck
    # beside the uploads or, if the uploads ended first, by the verify step: either counts.
    m = re.fullmatch(r"(\d+) copies re-hashed and matched: (\d+) as they were stored, (\d+) shared with "
                     r"earlier checkpoints beside the uploads, (\d+) now", detail)
    assert m, detail
    total, as_stored, beside, later = map(int, m.groups())
    assert (total, as_stored, beside + later) == (len(reps), fresh, len(reps) - fresh), detail
