"""Rotation deletes a local checkpoint only when every replica is confirmed elsewhere."""
from __future__ import annotations

import shutil

import pytest
from sqlalchemy import select, update

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, JobEvent, Shard
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
    cluster = make_cluster(env={"CKPT_KEEP_LAST": "1"})
    run = cluster.runs / "run"
    run.mkdir()
    old = atomic_save(state_dict(3), run / "step_1.safetensors")
    old_job = checkpoint_job(cluster, old)
    cluster.wait_job(old_job, ("verified",))
    rid = copies(cluster, old_job)[0][0]
    with session_scope(cluster.settings.db_url) as s:  # as if the re-hash after upload had not happened
        s.execute(update(ContentCopy).where(ContentCopy.id == rid).values(state="stored", verified_at=None))

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


def _timeline(cluster, job_id: int) -> list[str]:
    """The states the job went through, in order."""
    with session_scope(cluster.settings.db_url) as s:
        moved = JobEvent.from_state.is_(None) | (JobEvent.from_state != JobEvent.to_state)  # not a note
        return list(s.scalars(select(JobEvent.to_state).where(JobEvent.job_id == job_id, moved).order_by(JobEvent.id)))


def _keys(cluster, job_id: int) -> tuple[str | None, set[str | None]]:
    """The key of the job's last message, and those of the messages that sent its copies."""
    job = cluster.job(job_id)
    shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == job.checkpoint_id)
    stored_now = ContentCopy.stored_at >= job.created_at
    with session_scope(cluster.settings.db_url) as s:
        sent = set(s.scalars(select(ContentCopy.sent_key).where(ContentCopy.sha256.in_(shas), stored_now)))
    return job.sent_key, sent


def test_a_checkpoint_of_one_shard_is_replicated_and_verified_in_its_shard_message(make_cluster):
    """docs/design.md, "Continuing in the same thread": a checkpoint that fits in one shard is
    replicated and verified in the thread of its shard message (no message sent for its copies
    or its verification), every transition recorded, and rotation follows; a larger one sends
    its steps as messages, as before."""
    cluster = make_cluster(env={"CKPT_KEEP_LAST": "1"}, processes=1)
    run = cluster.runs / "run"
    run.mkdir()
    small = [atomic_save(state_dict(20 + i, layers=0), run / f"step_{i}.safetensors") for i in (1, 2)]
    assert all(p.stat().st_size < cluster.settings.shard_size for p in small)
    jobs = []
    for path in small:
        jobs.append(checkpoint_job(cluster, path))
        cluster.wait_job(jobs[-1], ("verified", "rotated"))
    cluster.wait_job(jobs[0], ("rotated",), timeout=60)
    assert not small[0].exists() and small[1].exists()
    assert _timeline(cluster, jobs[0]) == ["detected", "sharded", "replicated", "verified", "rotated"]
    assert _timeline(cluster, jobs[1]) == ["detected", "sharded", "replicated", "verified"]
    for job_id in jobs:
        key, copy_keys = _keys(cluster, job_id)
        assert key is not None and key.startswith("shard."), key  # no verify message was keyed on it
        assert copy_keys == {None}, copy_keys  # nor a replicate message on its new copies

    big = atomic_save(state_dict(30, layers=2), run / "step_3.safetensors")
    assert big.stat().st_size > cluster.settings.shard_size
    big_job = checkpoint_job(cluster, big)
    cluster.wait_job(big_job, ("verified",))
    cluster.wait_job(jobs[1], ("rotated",), timeout=60)  # rotation still follows its verification
    assert _timeline(cluster, big_job) == ["detected", "sharded", "replicated", "verified"]
    key, copy_keys = _keys(cluster, big_job)
    assert key is not None and key.startswith("verify."), key
    assert copy_keys and all(k is not None and k.startswith("replicate.") for k in copy_keys), copy_keys
