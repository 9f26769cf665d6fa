"""A store whose copies are damaged on every worker that holds one, before it is verified, is
not wedged: a worker holds one copy of a content, so with RF 2 on 3 workers the second damaged
copy leaves nowhere to place a replacement. Those copies are rebuilt in place from the local
file (a repair), and the store goes on to verified with RF good copies on the workers' disks."""
from __future__ import annotations

import hashlib
import os

import pytest

from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration


def test_copies_damaged_on_every_holder_before_verify_are_rebuilt_and_the_store_verifies(make_cluster, tmp_path):
    points = tmp_path / "failpoints"
    points.mkdir()
    # Every verify delivery pauses once its step began (committed: no lock held), while the test
    # truncates every stored copy (every delivery: two of one step may be in flight).
    (points / "verify.commit1.after").write_text("always sleep 5\n")
    cluster = make_cluster(env={"CKPT_FAILPOINTS": str(points), "CKPT_SCRUB_CRON": ""})
    run = cluster.runs / "run"
    run.mkdir()
    path = atomic_save(state_dict(5, layers=4, width=64), run / "step_1.safetensors")
    job_id = checkpoint_job(cluster, path)

    wait_for(lambda: (points / "verify.commit1.after.hits").exists(), 90, "the verify step to begin")
    held = cluster.copies(path, states=("stored", "verified"))
    holders: dict[str, set[str]] = {}
    for worker_id, sha, _seq in held:
        holders.setdefault(sha, set()).add(worker_id)
    assert holders and all(len(w) == 2 for w in holders.values()), held  # RF 2: each on 2 of the 3 workers
    for worker_id, sha, _seq in held:
        shard = cluster.worker(worker_id).shard(sha)
        os.truncate(shard, shard.stat().st_size // 2)

    job = cluster.wait_job(job_id, ("verified", "failed", "rotated"), timeout=120)
    assert job.state == "verified", (job.state, job.detail, cluster.logs())
    good: dict[str, set[str]] = {}
    for worker_id, sha, _seq in cluster.copies(path, states=("verified",)):
        p = cluster.worker(worker_id).shard(sha)
        if p.exists() and hashlib.sha256(p.read_bytes()).hexdigest() == sha:
            good.setdefault(sha, set()).add(worker_id)
    assert {sha for _, sha, _ in held} == set(good) and all(len(w) >= 2 for w in good.values()), good
