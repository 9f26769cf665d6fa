"""An object store as a tier of a real cluster: `ckpt up` (real Dramatiq, scheduler, watcher),
three storage worker processes, and a real SeaweedFS bucket as a ``[[targets]]`` target.

Copies on the bucket are copy rows like a worker's, confirmed by the store's own checksum, put by
a worker from its own copy through a presigned PUT (the trainer's host sends each byte once); the
tier policy decides whether rotation waits for them (``required``) or not (``lag``); a store
that cannot take a copy leaves it pending with its error, nothing marked lost, and it lands once
the store answers again (from a worker's copy when the local file is gone).
"""
from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, ContentCopy, JobEvent, Shard, StorageWorker
from pipeline.objectstore import keys
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job, make_cluster  # noqa: F401 (fixture)
from tests.objectstore.conftest import FlakyFront, raw_client
from tests.processes import wait_for, worker_client

pytestmark = pytest.mark.integration


def targets_env(endpoint: str, bucket: str, **policy: str) -> dict[str, str]:
    table = {"name": "store", "url": f"s3://{bucket}/ckpt", "endpoint": endpoint, "region": "us-east-1",
             "addressing_style": "path", "max_attempts": 2, "connect_timeout": 2, "read_timeout": 10}
    return {"CKPT_TARGETS": json.dumps([table]), "CKPT_KEEP_LAST": "1", **policy}


def store_copies(cluster, job_id: int) -> list[tuple[str, str, str | None, str | None]]:
    """(sha256, state, checksum, last_error) of the job's contents' copies on the object store."""
    with session_scope(cluster.settings.db_url) as s:
        cid = cluster.job(job_id).checkpoint_id
        shas = select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == cid)
        return [(c.sha256, c.state, c.checksum, c.last_error) for c in s.scalars(
            select(ContentCopy).join(StorageWorker, StorageWorker.id == ContentCopy.worker_id)
            .where(ContentCopy.sha256.in_(shas), StorageWorker.tier == "objectstore"))]


def contents(cluster, job_id: int) -> set[str]:
    with session_scope(cluster.settings.db_url) as s:
        cid = cluster.job(job_id).checkpoint_id
        return set(s.scalars(select(Shard.sha256).join(CheckpointFile).where(CheckpointFile.checkpoint_id == cid)))


def in_bucket(server, bucket: str) -> dict[str, int]:
    """The shards under the prefix (its .ckpt-home marker is not one)."""
    listed = raw_client(server).list_objects_v2(Bucket=bucket, Prefix="ckpt/").get("Contents", [])
    return {sha: o["Size"] for o in listed if (sha := keys.sha_of("ckpt", o["Key"])) is not None}


def test_required_copies_are_confirmed_by_the_store_before_the_local_copy_goes(make_cluster, server, bucket):  # noqa: F811
    cluster = make_cluster(env=targets_env(server.endpoint, bucket, CKPT_TARGET_MODE="required"))
    run = cluster.runs / "run"
    run.mkdir()
    old = atomic_save(state_dict(1), run / "step_1.safetensors")
    old_job = checkpoint_job(cluster, old)
    cluster.wait_job(old_job, ("verified",), timeout=90)

    wanted = contents(cluster, old_job)
    copies = store_copies(cluster, old_job)
    assert {sha for sha, state, _c, _e in copies if state == "verified"} == wanted
    # The store's own checksum of each object is recorded: the SHA-256 itself (one PUT each here).
    assert all(checksum == keys.full_checksum(sha) for sha, _s, checksum, _e in copies)
    held = in_bucket(server, bucket)
    assert wanted <= set(held)
    # Each object was put by a worker from its own copy (a presigned PUT): the trainer's host
    # sent the bytes once, to the workers, and nothing to the store.
    pushed = [worker_client(w).status().get("pushes", {}) for w in cluster.workers]
    assert sum(p.get("shards", 0) for p in pushed) == len(wanted), pushed

    new = atomic_save(state_dict(2), run / "step_2.safetensors")
    cluster.wait_job(checkpoint_job(cluster, new), ("verified",), timeout=90)
    cluster.wait_job(old_job, ("rotated",), timeout=60)
    assert not old.exists()
    with session_scope(cluster.settings.db_url) as s:
        row = s.get(StorageWorker, "target:store")
        assert row is not None and row.tier == "objectstore" and row.state == "up"
        assert row.url == f"s3://{bucket}/ckpt"


def store_up(cluster) -> bool:
    with session_scope(cluster.settings.db_url) as s:
        row = s.get(StorageWorker, "target:store")
        return row is not None and row.state == "up"


def test_a_throttling_store_holds_a_required_rotation_and_loses_nothing(make_cluster, server, bucket):  # noqa: F811
    front = FlakyFront(server.ports["s3.port"], 503, "SlowDown", failures=0)
    try:
        # The store stays up while it throttles, so that the copies are placed on it and sent (and
        # throttled) whenever the checkpoint is sharded: with the suite's 2 s, a probe could mark
        # it down first on a slow machine, and a job then waits on a store that is down (its
        # reason says so) with no copy ever sent.
        cluster = make_cluster(env=targets_env(front.endpoint, bucket, CKPT_TARGET_MODE="required",
                                               CKPT_WORKER_DOWN_SECONDS="300"))
        wait_for(lambda: store_up(cluster), 60, "the object store to be admitted")
        front.failures = 10**6  # from now on it throttles every request
        run = cluster.runs / "run"
        run.mkdir()
        old = atomic_save(state_dict(3), run / "step_1.safetensors")
        old_job = checkpoint_job(cluster, old)
        new = atomic_save(state_dict(4), run / "step_2.safetensors")
        new_job = checkpoint_job(cluster, new)

        # The workers take their copies; the store throttles: the job waits, saying why.
        def said() -> list[str]:
            with session_scope(cluster.settings.db_url) as s:
                return [d for d in s.scalars(select(JobEvent.detail).where(JobEvent.job_id == old_job))
                        if "waiting for its object-store copy" in d]
        notes = wait_for(said, 90, "the store job's timeline to say it waits for the store")
        assert "throttled (503)" in notes[0]
        assert cluster.job(old_job).state == "sharded" and old.exists()

        front.failures = 0  # the store takes requests again
        cluster.wait_job(old_job, ("rotated",), timeout=120)
        cluster.wait_job(new_job, ("verified",), timeout=60)
        assert contents(cluster, old_job) <= set(in_bucket(server, bucket))
        assert not old.exists() and new.exists()
    finally:
        front.close()


def test_a_store_down_before_the_checkpoint_is_sharded_holds_it_and_takes_its_copies_when_back(
        make_cluster, server, bucket):  # noqa: F811
    """The other order of the throttling above: the store is marked down (throttled past the
    suite's 2 s) before the checkpoint is sharded, so no copy is placed on it then. The job says
    which store it waits for and why; the copies are placed and sent once the store answers."""
    front = FlakyFront(server.ports["s3.port"], 503, "SlowDown", failures=0)
    try:
        cluster = make_cluster(env=targets_env(front.endpoint, bucket, CKPT_TARGET_MODE="required"))
        wait_for(lambda: store_up(cluster), 60, "the object store to be admitted")
        front.failures = 10**6

        def store_state() -> str | None:
            with session_scope(cluster.settings.db_url) as s:
                row = s.get(StorageWorker, "target:store")
                return row.state if row is not None else None
        wait_for(lambda: store_state() == "down", 60, "the throttling store to be marked down")
        run = cluster.runs / "run"
        run.mkdir()
        old = atomic_save(state_dict(9), run / "step_1.safetensors")
        old_job = checkpoint_job(cluster, old)
        new_job = checkpoint_job(cluster, atomic_save(state_dict(10), run / "step_2.safetensors"))

        reason = wait_for(lambda: (r := cluster.job(old_job).blocked_reason) and "object-store copies" in r and r, 90,
                          "the store job to say why it waits")
        assert "target:store is down" in reason and "throttled (503)" in reason, reason
        assert cluster.job(old_job).state == "sharded" and old.exists()
        assert store_copies(cluster, old_job) == []  # nothing placed on a store that is down

        front.failures = 0
        cluster.wait_job(old_job, ("rotated",), timeout=120)
        cluster.wait_job(new_job, ("verified",), timeout=60)
        assert contents(cluster, old_job) <= set(in_bucket(server, bucket))
        assert not old.exists()
    finally:
        front.close()


def test_lagging_copies_do_not_hold_rotation_and_land_from_a_worker_once_the_store_answers(make_cluster, server,  # noqa: F811
                                                                                           bucket):
    front = FlakyFront(server.ports["s3.port"], 503, "SlowDown", failures=0)
    try:
        cluster = make_cluster(env=targets_env(front.endpoint, bucket))  # target_mode lag (the default)
        wait_for(lambda: store_up(cluster), 60, "the object store to be admitted")
        front.failures = 10**6
        run = cluster.runs / "run"
        run.mkdir()
        old = atomic_save(state_dict(5), run / "step_1.safetensors")
        old_job = checkpoint_job(cluster, old)
        cluster.wait_job(old_job, ("verified",), timeout=90)
        new = atomic_save(state_dict(6), run / "step_2.safetensors")
        cluster.wait_job(checkpoint_job(cluster, new), ("verified",), timeout=90)
        cluster.wait_job(old_job, ("rotated",), timeout=60)  # the lagging copies do not hold it
        assert not old.exists()
        assert all(state != "verified" for _s, state, _c, _e in store_copies(cluster, old_job))

        front.failures = 0  # the local file is gone: its copies come from the workers' copies
        wanted = contents(cluster, old_job)
        wait_for(lambda: {sha for sha, state, _c, _e in store_copies(cluster, old_job) if state == "verified"}
                 == wanted, 120, "the lagging copies to land")
        assert wanted <= set(in_bucket(server, bucket))
    finally:
        front.close()


def test_a_forgotten_checkpoints_content_is_collected_from_the_bucket(make_cluster, server, bucket):  # noqa: F811
    cluster = make_cluster(env=targets_env(server.endpoint, bucket, CKPT_TARGET_MODE="required",
                                           CKPT_GC_GRACE_SECONDS="0", CKPT_GC_CRON=""))
    run = cluster.runs / "run"
    run.mkdir()
    old_job = checkpoint_job(cluster, atomic_save(state_dict(7), run / "step_1.safetensors"))
    cluster.wait_job(old_job, ("verified",), timeout=90)
    new_job = checkpoint_job(cluster, atomic_save(state_dict(8), run / "step_2.safetensors"))
    cluster.wait_job(new_job, ("verified",), timeout=90)
    cluster.wait_job(old_job, ("rotated",), timeout=60)  # its local copy is gone: forgetting it frees its content
    gone, kept = contents(cluster, old_job) - contents(cluster, new_job), contents(cluster, new_job)
    assert gone and gone | kept <= set(in_bucket(server, bucket))

    r = cluster.cli("forget", str(cluster.job(old_job).checkpoint_id))
    assert r.returncode == 0, r.stdout + r.stderr
    r = cluster.cli("gc", "--wait", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    held = set(in_bucket(server, bucket))
    assert not gone & held and kept <= held
    assert store_copies(cluster, old_job) == [c for c in store_copies(cluster, old_job) if c[0] in kept]


def test_refused_credentials_are_one_clear_reason_and_nothing_is_marked_lost(make_cluster, server, bucket):  # noqa: F811
    env = targets_env(server.endpoint, bucket, CKPT_TARGET_MODE="required", AWS_SECRET_ACCESS_KEY="not-the-key")
    cluster = make_cluster(env=env)
    run = cluster.runs / "run"
    run.mkdir()
    old = atomic_save(state_dict(7), run / "step_1.safetensors")
    old_job = checkpoint_job(cluster, old)
    atomic_save(state_dict(8), run / "step_2.safetensors")

    # The workers hold its copies; the store refuses the credentials: the job says so, once clear.
    reason = wait_for(lambda: (r := cluster.job(old_job).blocked_reason) and "object-store copies" in r and r, 90,
                      "the store job to say why it waits")
    assert "target:store" in reason and "credentials" in reason, reason
    assert cluster.job(old_job).state == "sharded" and old.exists()
    with session_scope(cluster.settings.db_url) as s:
        damaged = s.scalars(select(ContentCopy.state).where(ContentCopy.state.in_(("corrupt", "missing")))).all()
    assert damaged == []
    assert in_bucket(server, bucket) == {}
