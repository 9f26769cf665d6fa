"""Rotation deletes a local checkpoint only when every replica is confirmed elsewhere."""
from __future__ import annotations

import shutil

import pytest
from sqlalchemy import select, update

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, Job, Shard
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job
from tests.processes import wait_for

pytestmark = pytest.mark.integration


def copies(cluster, job_id):
    """Verified copies of the job's tensor shards. (The header shard is skipped: a later
    checkpoint with the same layout has the very same header shard: its content is shared.)"""
    with session_scope(cluster.settings.db_url) as s:
        cid = cluster.job(job_id).checkpoint_id
        return [(c.id, c.worker_id, c.sha256) for c in s.scalars(
            select(ContentCopy).join(Shard, Shard.sha256 == ContentCopy.sha256).join(CheckpointFile)
            .where(CheckpointFile.checkpoint_id == cid, ContentCopy.state == "verified",
                   Shard.kind == "safetensors"))]


def shard_file(cluster, worker_id: str, sha: str):
    for w in cluster.workers:
        if (w.data / "node_id").read_text().strip() == worker_id:
            return w.data / "shards" / sha[:2] / sha[2:4] / sha
    raise AssertionError(worker_id)


def test_rotation_refuses_while_a_replica_is_missing_and_deletes_once_confirmed(make_cluster, tmp_path):
    cluster = make_cluster(env={"CKPT_KEEP_LAST": "1"})
    run = cluster.runs / "run"
    run.mkdir()
    old = atomic_save(state_dict(1), run / "step_1.safetensors")
    old_job = checkpoint_job(cluster, old)
    cluster.wait_job(old_job, ("verified",))

    # A copy vanishes from a worker's disk after it was verified.
    _rid, worker_id, sha = copies(cluster, old_job)[0]
    victim = shard_file(cluster, worker_id, sha)
    shutil.move(victim, tmp_path / "aside")

    new = atomic_save(state_dict(2), run / "step_2.safetensors")
    cluster.wait_job(checkpoint_job(cluster, new), ("verified",))
    blocked = wait_for(lambda: cluster.job(old_job).blocked_reason, 30, "rotation to be blocked")
    assert "rotation blocked" in blocked and sha[:12] in blocked
    assert old.exists() and cluster.job(old_job).state == "verified"

    shutil.move(tmp_path / "aside", victim)  # the copy is back: the next sweep may delete
    cluster.wait_job(old_job, ("rotated",), timeout=60)
    assert not old.exists() and new.exists()


def test_rotation_refuses_while_a_replica_is_unverified(make_cluster):
    # Two workers for RF 2: with a third, the under-replication sweep heals the content (a copy
    # placed there) and rotation rightly goes on; whether the sweep or the rotation came first
    # depended on the machine's load (it failed in full runs only).
    cluster = make_cluster(workers=2, env={"CKPT_KEEP_LAST": "1"})
    run = cluster.runs / "run"
    run.mkdir()
    old = atomic_save(state_dict(3), run / "step_1.safetensors")
    old_job = checkpoint_job(cluster, old)
    cluster.wait_job(old_job, ("verified",))
    rid = copies(cluster, old_job)[0][0]
    with session_scope(cluster.settings.db_url) as s:  # as if the re-hash after upload had not happened
        s.execute(update(ContentCopy).where(ContentCopy.id == rid).values(state="stored", verified_at=None))
        sha = s.get(ContentCopy, rid).sha256

    # The sweep's repair has no worker to place the missing copy on: it waits, saying so (it used
    # to raise and be retried into the dead letters).
    def repair_waits():
        with session_scope(cluster.settings.db_url) as s:
            return s.execute(select(Job.blocked_reason, Job.state, Job.attempts)
                             .where(Job.kind == "repair", Job.sha256 == sha, Job.blocked_reason.is_not(None))).first()

    why, state, attempts = wait_for(repair_waits, 30, "the repair to wait")
    assert "waiting for a storage worker to place a copy on" in why and "RF 2" in why
    assert (state, attempts) == ("repairing", 0)

    new = atomic_save(state_dict(4), run / "step_2.safetensors")
    cluster.wait_job(checkpoint_job(cluster, new), ("verified",))
    blocked = wait_for(lambda: cluster.job(old_job).blocked_reason, 30, "rotation to be blocked")
    assert "1/2 fresh verified replicas" in blocked
    assert old.exists()

    with session_scope(cluster.settings.db_url) as s:
        s.execute(update(ContentCopy).where(ContentCopy.id == rid)
                  .values(state="verified", verified_at=ContentCopy.stored_at))
    cluster.wait_job(old_job, ("rotated",), timeout=60)
    assert not old.exists()
