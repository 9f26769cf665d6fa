"""Exhausted retries: the job is 'failed' with its error, the message is dead-lettered, and a
requeue resumes it once the cause is gone. A store the cluster has no room for is not a
failure: it waits, saying why, and goes on when a worker joins."""
from __future__ import annotations

import json
import re

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration


def test_a_step_that_keeps_failing_is_dead_lettered_then_requeue_completes(make_cluster, tmp_path):
    points = tmp_path / "failpoints"
    points.mkdir()
    (points / "verify.commit1.before").write_text("always raise\n")  # every verify fails, until removed
    cluster = make_cluster(env={"CKPT_FAILPOINTS": str(points), "CKPT_MAX_RETRIES": "2"})
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(11), run / "step_1.safetensors")
    job_id = checkpoint_job(cluster, path)

    job = cluster.wait_job(job_id, ("failed",), timeout=90)
    assert "FailpointError" in job.last_error
    r = cluster.cli("dead-letters", "--json")
    assert r.returncode == 0, r.stderr
    letters = json.loads(r.stdout)
    assert [(d["actor"], d["args"]) for d in letters] == [("verify", [job_id])]
    assert "FailpointError" in letters[0]["traceback"]

    (points / "verify.commit1.before").unlink()  # the cause is gone
    r = cluster.cli("dead-letters", "--requeue", "all")
    assert r.returncode == 0 and "requeued 1" in r.stdout, r.stderr
    cluster.wait_job(job_id, ("verified",), timeout=90)
    assert json.loads(cluster.cli("dead-letters", "--json").stdout) == []


def test_a_store_the_cluster_cannot_place_waits_and_goes_on_when_a_worker_joins(make_cluster):
    # A waiting store is retried when its lease ends (waiting -> detected -> waiting): a lease of
    # 30 s holds it waiting while the test reads its status (5 s let a loaded machine catch a retry).
    cluster = make_cluster(workers=3, spare_workers=1, env={"CKPT_RF": "4", "CKPT_LEASE_SECONDS": "30"})
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(12), run / "step_1.safetensors")
    job_id = checkpoint_job(cluster, path)

    job = cluster.wait_job(job_id, ("waiting",), timeout=60)
    assert "cluster full" in job.blocked_reason and "on 4 distinct workers, and only 3 of 3" in job.blocked_reason
    r = cluster.cli("status", "--verbose")
    assert "waiting" in r.stdout and "cluster full" in r.stdout, r.stdout
    row = next(line for line in r.stdout.splitlines() if line.endswith("step_1.safetensors"))
    assert re.match(r"\s*\d+\s+1\s+\d+ s ago\s+waiting\s", row), row  # its step, how long ago it was written
    assert json.loads(cluster.cli("dead-letters", "--json").stdout) == []  # waiting is not failing

    cluster.workers[3].start()  # room appears: a fourth worker joins
    cluster.wait_job(job_id, ("verified",), timeout=90)
    wait_for(lambda: cluster.job(job_id).blocked_reason is None, 10, "the wait reason cleared")
