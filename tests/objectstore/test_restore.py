"""Restore from an object store when no storage worker can send a shard (all workers lost).

A real cluster (``ckpt up`` with its Dramatiq worker and scheduler, storage worker processes)
protects HF Trainer folders (safetensors files and opaque trainer files); the test puts every
content on a real SeaweedFS bucket itself (the bytes read back from a worker's disk) and records
each as a verified copy on the target's row, then loses workers and restores through ``ckpt
restore --wait``. The cluster reaches the bucket through a front the test can make answer 503
throughout or vanish (nothing listening on its port).
"""
from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import select

from bench import seaweed
from pipeline.db.copies import move, new_copy
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, CheckpointFile, Content, ContentCopy, JobEvent, Shard, StorageWorker
from pipeline.objectstore import keys
from pipeline.objectstore.client import ObjectStore
from pipeline.objectstore.config import to_json
from pipeline.objectstore.tier import probe
from pipeline.restoring.loader import load_state_dict
from pipeline.states import CopyState, WorkerState
from tests.checkpoints import files_of, hf_folder
from tests.integration.conftest import checkpoint_job
from tests.objectstore.conftest import FlakyFront, drop_bucket, make_target, raw_client
from tests.processes import Cluster

pytestmark = pytest.mark.integration

ROW = "target:store"


class Front:
    """The cluster's way to the bucket: passes everything through, answers 503 SlowDown to
    every request (``throttled``), or is gone (``unreachable``: nothing listens on its port)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.flaky = FlakyFront(upstream_port, 503, "SlowDown", 0)
        self.port = self.flaky.httpd.server_address[1]
        self.endpoint = self.flaky.endpoint

    @contextlib.contextmanager
    def faulty(self, fault: str) -> Iterator[None]:
        if fault == "throttled":
            self.flaky.failures = 10**9
        else:
            self.flaky.close()
        try:
            yield
        finally:
            if fault == "throttled":
                self.flaky.failures = 0
            else:
                self.flaky = FlakyFront(self.upstream, 503, "SlowDown", 0, port=self.port)

    def close(self) -> None:
        self.flaky.close()


@pytest.fixture(scope="module")
def aws(server):
    """This process's environment as the cluster's: the server's key pair and nothing else."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                     "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", seaweed.ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", seaweed.SECRET_KEY)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


@pytest.fixture(scope="module")
def bucket(server, aws) -> Iterator[str]:
    name = "restore-tier"
    raw_client(server).create_bucket(Bucket=name)
    yield name
    drop_bucket(server, name)


@pytest.fixture(scope="module")
def front(server) -> Iterator[Front]:
    f = Front(server.ports["s3.port"])
    yield f
    f.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, front, bucket) -> Iterator[Cluster]:
    # Short transfer knobs, so a store that cannot serve is given up on in seconds; workers are
    # never marked down meanwhile (a killed one stays a copy tried first, and refused).
    target = make_target(front.endpoint, bucket, max_attempts=2, connect_timeout=2, read_timeout=10)
    c = Cluster(tmp_path_factory.mktemp("restore-tier"), workers=2,
                env={"CKPT_TARGETS": to_json([target]), "CKPT_WORKER_DOWN_SECONDS": "600"})
    try:
        yield c.start()
    finally:
        c.stop()


def workers_back(cluster: Cluster) -> None:
    for w in cluster.workers:
        if w.proc is None or w.proc.poll() is not None:
            w.start()
    cluster._remember_pids()


def lose_every_worker(cluster: Cluster) -> None:
    for w in cluster.workers:
        if w.proc is not None and w.proc.poll() is None:
            w.kill()


def protect(cluster: Cluster, seed: int) -> Path:
    run = cluster.runs / f"run-{seed}"
    run.mkdir()
    path = hf_folder(run / "checkpoint-100", seed=seed)
    cluster.wait_job(checkpoint_job(cluster, path), ("verified",))
    return path


def shards_of(cluster: Cluster, path: Path) -> list[tuple[str, int, str]]:
    """(sha256, size, kind) of every shard of the checkpoint at ``path``."""
    with session_scope(cluster.settings.db_url) as s:
        ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == str(path.resolve()), Checkpoint.current.is_(True)))
        return [tuple(r) for r in s.execute(select(Shard.sha256, Shard.size, Shard.kind).join(CheckpointFile)
                                            .where(CheckpointFile.checkpoint_id == ckpt.id))]


def put_on_bucket(cluster: Cluster, path: Path) -> Counter[str]:
    """Every content of the checkpoint at ``path`` put on the bucket (its bytes read from a
    worker's disk), confirmed by the store, and recorded as a verified copy on the target's row
    (recorded and probed by pipeline.objectstore.tier.probe); the number of shards of each content."""
    store = ObjectStore(cluster.settings.object_targets()[0])
    probe(cluster.settings)  # records the target's row and asks its bucket: up
    with session_scope(cluster.settings.db_url) as s:
        assert s.get(StorageWorker, ROW).state == WorkerState.UP
    shards = shards_of(cluster, path)
    with session_scope(cluster.settings.db_url) as s:
        holder = dict(s.execute(select(ContentCopy.sha256, ContentCopy.worker_id).where(
            ContentCopy.sha256.in_({sha for sha, _size, _kind in shards}),
            ContentCopy.state == CopyState.VERIFIED, ContentCopy.worker_id != ROW)).all())
    checksums = {}
    for sha, size, _kind in set(shards):
        stored = store.put(sha, cluster.worker(holder[sha]).shard(sha))
        checksums[sha] = store.confirm(sha, size, stored.checksum).checksum
    with session_scope(cluster.settings.db_url) as s:
        for sha, checksum in checksums.items():
            if s.scalar(select(ContentCopy.id).where(ContentCopy.sha256 == sha, ContentCopy.worker_id == ROW)):
                continue  # shared with a checkpoint put there before
            copy = new_copy(s.get(Content, sha), ROW)
            s.flush()
            move(s, copy, CopyState.STORED)
            move(s, copy, CopyState.VERIFIED)
            copy.checksum = checksum
    return Counter(sha for sha, _size, _kind in shards)


@pytest.fixture(scope="module")
def saved(cluster, bucket) -> dict[str, Path]:
    """Two checkpoints protected on the workers, then every content of both put on the bucket
    too. Both are stored before anything is on the bucket: they share contents (the trainer
    files), and verification re-hashing a shared content does not know object-store copies yet."""
    paths = {name: protect(cluster, seed) for name, seed in (("mixed", 31), ("lost", 40))}
    for path in paths.values():
        put_on_bucket(cluster, path)
    return paths


def restore(cluster: Cluster, path: Path, dest: Path) -> tuple[int, str, int]:
    """``ckpt restore PATH --to DEST --wait``: (exit code, what it said, the job's id)."""
    r = cluster.cli("restore", str(path), "--to", str(dest), "--wait", "--timeout", "120", timeout=180)
    m = re.search(r"restore job (\d+):", r.stdout)
    assert m, (r.stdout, r.stderr)
    return r.returncode, r.stdout + r.stderr, int(m.group(1))


def timeline(cluster: Cluster, job_id: int) -> list[tuple[str, str]]:
    """The job's timeline: (state, detail) of each entry, a failed attempt's note included."""
    with session_scope(cluster.settings.db_url) as s:
        return [(to, detail or "") for to, detail in s.execute(
            select(JobEvent.to_state, JobEvent.detail).where(JobEvent.job_id == job_id).order_by(JobEvent.id))]


def nothing_written(dest: Path) -> None:
    assert not dest.exists()
    assert not [p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]


def test_shards_no_worker_holds_come_from_the_object_store_the_rest_from_workers(cluster, bucket, saved, tmp_path):
    workers_back(cluster)
    path = saved["mixed"]
    per_content = Counter(sha for sha, _size, _kind in shards_of(cluster, path))
    lost = next(sha for sha, _size, kind in shards_of(cluster, path) if kind == "safetensors")
    for w in cluster.workers:  # every worker copy of one content is gone; the workers still run
        w.shard(lost).parent.chmod(0o755)
        w.shard(lost).unlink()

    dest = tmp_path / "restored"
    code, said, job_id = restore(cluster, path, dest)

    assert code == 0, said
    assert files_of(dest) == files_of(path)
    total, from_store = sum(per_content.values()), per_content[lost]
    read = f"read {total - from_store} shards from workers, {from_store} from object store s3://{bucket}/ckpt"
    assert f"done: restored to {dest}: {read}" in said
    assert dict(timeline(cluster, job_id))["verified"].endswith(f"match their recorded SHA-256; {read}")


def test_with_every_storage_worker_lost_the_checkpoint_comes_back_from_the_object_store(cluster, bucket, saved,
                                                                                        tmp_path):
    saved = saved["lost"]
    lose_every_worker(cluster)
    dest = tmp_path / "restored"
    code, said, job_id = restore(cluster, saved, dest)

    assert code == 0, said
    assert files_of(dest) == files_of(saved)
    read = f"read {len(shards_of(cluster, saved))} shards from object store s3://{bucket}/ckpt"
    assert f"done: restored to {dest}: {read}" in said and "from workers" not in said
    assert dict(timeline(cluster, job_id))["done"] == f"restored to {dest}: {read}"

    loaded = load_state_dict(str(saved), cluster.settings)  # tensors straight from the store's shards
    reference = {k: v for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


@pytest.mark.parametrize(("fault", "says"), [("throttled", "throttled (SlowDown)"),
                                             ("unreachable", "endpoint unreachable")])
def test_a_store_that_cannot_serve_ends_the_restore_with_one_clear_error_and_writes_nothing(
        cluster, front, bucket, saved, tmp_path, fault, says):
    lose_every_worker(cluster)
    dest = tmp_path / "restored"
    started = time.monotonic()
    with front.faulty(fault):
        code, said, job_id = restore(cluster, saved["lost"], dest)
    took = time.monotonic() - started

    assert code == 1, said
    job = cluster.job(job_id)
    assert job.state == "failed"
    for text in (job.last_error, said):
        assert f"its last copy is on object store s3://{bucket}/ckpt, which cannot serve it now" in text
        assert says in text and "restore again once the store answers" in text
    assert "every storage worker copy failed" in job.last_error  # the workers were tried first
    assert [to for to, _ in timeline(cluster, job_id)] == ["queued", "gathering", "failed"]  # ended, not retried
    nothing_written(dest)
    assert took < 60


def test_a_tampered_object_on_the_store_is_refused_not_restored(cluster, server, bucket, saved, tmp_path):
    saved = saved["lost"]
    lose_every_worker(cluster)
    sha = next(sha for sha, _size, kind in shards_of(cluster, saved) if kind == "safetensors")
    key = keys.key_for("ckpt", sha)
    raw = raw_client(server)
    good = raw.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    raw.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    dest = tmp_path / "restored"
    try:
        code, said, job_id = restore(cluster, saved, dest)
    finally:
        raw.put_object(Bucket=bucket, Key=key, Body=good)

    assert code == 1, said
    error = cluster.job(job_id).last_error
    assert f"shard {sha[:12]} from object store s3://{bucket}/ckpt: SHA-256" in error
    assert "does not match manifest" in error
    nothing_written(dest)
