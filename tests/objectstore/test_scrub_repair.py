"""Scrub and repair across tiers, against a real S3 server (SeaweedFS on loopback).

In-process: an object store's copies are checked by the store's checksum and read back; a
tampered object is other bytes, a deleted one absent, and a store that throttles answers
nothing more (what it answered before stands). In a real cluster (`ckpt up`, three storage
worker processes, the bucket as a ``[[targets]]`` target): scrub finds a tampered and a deleted
object and repair puts them again; workers that lost every copy of a content are rebuilt from
the bucket; a store that throttles during a scrub marks nothing corrupt or missing.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.models import ContentCopy, Job
from pipeline.integrity.scrub import read_back_on_store, whole_turn
from pipeline.objectstore.tier import store_for
from tests.checkpoints import atomic_save, state_dict
from tests.integration.conftest import checkpoint_job, make_cluster  # noqa: F401 (fixture)
from tests.objectstore.conftest import FlakyFront, raw_client
from tests.objectstore.test_tier import contents, in_bucket, store_copies, store_up, targets_env
from tests.processes import wait_for

QUIET = {"CKPT_SCRUB_CRON": "", "CKPT_TARGET_MODE": "required", "CKPT_TARGET_SCRUB_SAMPLE": "1.0"}


def store_settings(tmp_path: Path, endpoint: str, bucket: str, **env: str) -> settings_mod.Settings:
    table = {"name": "store", "url": f"s3://{bucket}/ckpt", "endpoint": endpoint, "region": "us-east-1",
             "addressing_style": "path", "max_attempts": 2, "connect_timeout": 2, "read_timeout": 10}
    return settings_mod.load(environ={"CKPT_HOME": str(tmp_path / "home"), "CKPT_TARGETS": json.dumps([table]),
                                      **env}, recorded=False)


def put_shards(settings: settings_mod.Settings, tmp_path: Path, n: int) -> dict[str, tuple[int, str | None]]:
    """``n`` shards put on the store as the replicate step does: name -> (size, the store's checksum)."""
    store = store_for(settings, "target:store")
    out = {}
    for i in range(n):
        data = os.urandom(100_000 + i)
        sha = hashlib.sha256(data).hexdigest()
        (tmp_path / sha).write_bytes(data)
        out[sha] = (len(data), store.put(sha, tmp_path / sha).checksum)
    return out


def tamper(server, bucket: str, sha: str) -> None:
    """Other bytes of the same length under the name, written past our client (a person, a bug)."""
    key = f"ckpt/{sha[:2]}/{sha}"
    raw = raw_client(server)
    data = bytearray(raw.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_read_back_tells_tampered_from_absent_from_good(server, bucket, tmp_path):
    settings = store_settings(tmp_path, server.endpoint, bucket, CKPT_TARGET_SCRUB_SAMPLE="1.0")
    good, tampered, deleted = sorted(put_shards(settings, tmp_path, 3).items())
    tamper(server, bucket, tampered[0])
    raw_client(server).delete_object(Bucket=bucket, Key=f"ckpt/{deleted[0][:2]}/{deleted[0]}")

    answers, wait = read_back_on_store(settings, "target:store", dict([good, tampered, deleted]), day=0)
    assert wait is None
    assert answers[good[0]] == {"name": good[0], "sha256": good[0], "size": good[1][0]}  # every byte read
    assert answers[deleted[0]]["sha256"] is None
    assert answers[tampered[0]]["sha256"] not in (None, tampered[0]) and answers[tampered[0]]["error"]


def test_a_sampled_read_back_reads_part_of_an_object_and_the_whole_on_its_turn(server, bucket, tmp_path):
    settings = store_settings(tmp_path, server.endpoint, bucket, CKPT_TARGET_SCRUB_SAMPLE="0.1",
                              CKPT_TARGET_SCRUB_FULL_DAYS="7")
    store = store_for(settings, "target:store")
    data = os.urandom(40 * 2**20)  # 5 ranges of 8 MiB (the default part size): the first and last sampled
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "big").write_bytes(data)
    expect = {sha: (len(data), store.put(sha, tmp_path / "big").checksum)}
    turn = next(d for d in range(7) if whole_turn(sha, d, 7))
    sampled, _ = read_back_on_store(settings, "target:store", expect, day=turn + 1)
    whole, _ = read_back_on_store(settings, "target:store", expect, day=turn + 7)
    assert sampled[sha]["sha256"] == sha and sampled[sha]["size"] == 16 * 2**20
    assert whole[sha]["size"] == len(data)


def test_a_throttling_store_answers_nothing_more_and_what_it_answered_stands(server, bucket, tmp_path):
    front = FlakyFront(server.ports["s3.port"], 503, "SlowDown", failures=0)
    try:
        settings = store_settings(tmp_path, front.endpoint, bucket, CKPT_TARGET_SCRUB_SAMPLE="1.0")
        shards = put_shards(settings, tmp_path, 2)
        front.failures = 10**6
        answers, wait = read_back_on_store(settings, "target:store", shards, day=0)
        assert answers == {} and wait is not None and "throttled (503)" in wait
    finally:
        front.close()



def copy_rows(cluster, sha: str) -> dict[str, str]:
    with session_scope(cluster.settings.db_url) as s:
        return dict(s.execute(select(ContentCopy.worker_id, ContentCopy.state).where(ContentCopy.sha256 == sha)).all())


def jobs(cluster, kind: str) -> list[Job]:
    with session_scope(cluster.settings.db_url) as s:
        return list(s.scalars(select(Job).where(Job.kind == kind).order_by(Job.id)))


def protected(cluster, seed: int, name: str = "step_1.safetensors") -> tuple[Path, int]:
    """A checkpoint of run ``run`` saved and verified: its path and store job."""
    run = cluster.runs / "run"
    run.mkdir(exist_ok=True)
    path = atomic_save(state_dict(seed), run / name)
    job = checkpoint_job(cluster, path)
    cluster.wait_job(job, ("verified",), timeout=90)
    return path, job


def object_bytes(server, bucket: str, sha: str) -> bytes | None:
    try:
        return raw_client(server).get_object(Bucket=bucket, Key=f"ckpt/{sha[:2]}/{sha}")["Body"].read()
    except raw_client(server).exceptions.NoSuchKey:
        return None


@pytest.mark.integration
def test_scrub_finds_a_tampered_and_a_deleted_object_and_repair_puts_them_again(make_cluster, server,  # noqa: F811
                                                                                bucket):
    cluster = make_cluster(env=targets_env(server.endpoint, bucket, **QUIET))
    _path, job = protected(cluster, 11)
    tampered, deleted = sorted(contents(cluster, job))[:2]
    tamper(server, bucket, tampered)
    raw_client(server).delete_object(Bucket=bucket, Key=f"ckpt/{deleted[:2]}/{deleted}")

    r = cluster.cli("scrub", "--wait", timeout=120)
    assert r.returncode == 0, r.stderr + cluster.logs()
    (scrub,) = [j for j in jobs(cluster, "scrub") if j.params["worker_id"] == "target:store"]
    assert scrub.params["bad"] == 2 and scrub.params["checked"] == len(contents(cluster, job))

    def repaired(sha: str) -> bool:
        data = object_bytes(server, bucket, sha)
        return data is not None and hashlib.sha256(data).hexdigest() == sha and \
            copy_rows(cluster, sha)["target:store"] == "verified"

    for sha in (tampered, deleted):
        wait_for(lambda sha=sha: repaired(sha), 90, f"the object {sha[:12]} to be put again")
    wait_for(lambda: all(j.state == "done" for j in jobs(cluster, "repair")), 60, "the repairs to finish")
    assert {sha for sha, state, _c, _e in store_copies(cluster, job) if state == "verified"} == contents(cluster, job)


@pytest.mark.integration
def test_workers_that_lost_every_copy_are_rebuilt_from_the_bucket(make_cluster, server, bucket):  # noqa: F811
    cluster = make_cluster(env=targets_env(server.endpoint, bucket, **QUIET))
    old, old_job = protected(cluster, 12)
    protected(cluster, 13, "step_2.safetensors")
    cluster.wait_job(old_job, ("rotated",), timeout=60)  # no local file is left of the old one
    assert not old.exists()

    gone = [c for c in cluster.copies(old) if not c[0].startswith("target:")]
    victim = gone[0][1]
    for worker_id, sha, _seq in gone:
        if sha == victim:  # every worker's copy of one content
            cluster.worker(worker_id).shard(sha).unlink()
    holders = [w for w, sha, _seq in gone if sha == victim]
    assert len(holders) == 2 and victim in in_bucket(server, bucket)

    r = cluster.cli("scrub", "--wait", timeout=120)
    assert r.returncode == 0, r.stderr + cluster.logs()

    def rebuilt() -> bool:
        good = [w for w, state in copy_rows(cluster, victim).items()
                if state == "verified" and not w.startswith("target:")]
        return len(good) >= 2 and all(
            hashlib.sha256(cluster.worker(w).shard(victim).read_bytes()).hexdigest() == victim for w in good)

    wait_for(rebuilt, 90, "the workers' copies to be rebuilt from the bucket")
    repair = wait_for(lambda: [j for j in jobs(cluster, "repair") if j.state in ("done", "lost", "failed")], 60,
                      "the repair's verdict")[0]
    assert repair.state == "done", repair.last_error
    status = json.loads(cluster.cli("status", "--json").stdout)
    assert all(c["health"] != "lost" for c in status["checkpoints"])


@pytest.mark.integration
def test_a_store_throttling_during_scrub_marks_nothing_and_the_scrub_goes_on_after(make_cluster, server,  # noqa: F811
                                                                                     bucket):
    front = FlakyFront(server.ports["s3.port"], 503, "SlowDown", failures=0)
    try:
        # The store stays up while it throttles (a down one is not scrubbed: nothing to see then).
        cluster = make_cluster(env=targets_env(front.endpoint, bucket, CKPT_WORKER_DOWN_SECONDS="300", **QUIET))
        wait_for(lambda: store_up(cluster), 60, "the object store to be admitted")
        _path, job = protected(cluster, 14)
        before = store_copies(cluster, job)
        assert all(state == "verified" for _s, state, _c, _e in before)

        front.failures = 10**6  # from now on it throttles every request
        r = cluster.cli("scrub")
        assert r.returncode == 0, r.stderr

        def scrub_of_store() -> Job | None:
            return next((j for j in jobs(cluster, "scrub") if j.params["worker_id"] == "target:store"), None)

        blocked = wait_for(lambda: (j := scrub_of_store()) and j.blocked_reason, 90, "the scrub to say it waits")
        assert "throttled (503)" in blocked and scrub_of_store().state == "scrubbing"
        assert all(state == "verified" for _s, state, _c, _e in store_copies(cluster, job))
        assert not jobs(cluster, "repair")

        front.failures = 0
        done = wait_for(lambda: (j := scrub_of_store()) and j.state == "done" and j, 90, "the scrub to go on")
        assert done.params["bad"] == 0 and done.params["checked"] == len(before) and done.blocked_reason is None
        assert all(state == "verified" for _s, state, _c, _e in store_copies(cluster, job))
        assert not jobs(cluster, "repair")
    finally:
        front.close()
