"""Exhausted retries: the job is 'failed' with its error, the message is dead-lettered, and a
requeue resumes it once the cause is gone."""
from __future__ import annotations

import json

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job

pytestmark = pytest.mark.integration


def test_store_without_enough_workers_fails_then_requeue_completes(make_cluster):
    cluster = make_cluster(workers=3, spare_workers=1, env={"CKPT_RF": "4", "CKPT_MAX_RETRIES": "2"})
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(11), run / "step_1.safetensors")
    job_id = checkpoint_job(cluster, path)

    job = cluster.wait_job(job_id, ("failed",), timeout=60)
    assert "need 4 distinct live storage workers, have 3" in job.last_error
    r = cluster.cli("dead-letters", "--json")
    assert r.returncode == 0, r.stderr
    letters = json.loads(r.stdout)
    assert [(d["actor"], d["args"]) for d in letters] == [("shard", [job_id])]
    assert "PlacementError" in letters[0]["traceback"]

    cluster.workers[3].start()  # the cause is fixed: a fourth worker joins
    r = cluster.cli("dead-letters", "--requeue", "all")
    assert r.returncode == 0 and "requeued 1" in r.stdout, r.stderr
    cluster.wait_job(job_id, ("verified",), timeout=90)
    assert json.loads(cluster.cli("dead-letters", "--json").stdout) == []
