"""A storage worker puts its own copy on an object store through a presigned PUT (workers/push.py):
a real worker process, a real SeaweedFS. The worker holds no credential; the SHA-256 signed into
the URL makes the store refuse any other bytes."""
from __future__ import annotations

import hashlib
import os

import pytest

from pipeline.errors import ObjectMissing, WorkerError
from pipeline.objectstore.client import ObjectStore
from pipeline.objectstore.keys import full_checksum
from tests.objectstore.conftest import make_target
from tests.processes import StorageWorker, base_env, worker_client


@pytest.fixture
def worker(tmp_path):
    w = StorageWorker(tmp_path / "w", base_env(tmp_path / "home"), tmp_path / "w.log").start()
    try:
        yield w
    finally:
        w.stop()


def held_by(w, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    worker_client(w).put_range(sha, b"", _file(w, data), 0, len(data))
    return sha


def _file(w, data: bytes) -> str:
    path = w.data.parent / f"src-{hashlib.sha256(data).hexdigest()[:8]}"
    path.write_bytes(data)
    return str(path)


def test_a_worker_puts_its_copy_with_a_presigned_put_and_the_store_proves_it(worker, server, bucket):
    store = ObjectStore(make_target(server.endpoint, bucket))
    data = os.urandom(300_000)
    sha = held_by(worker, data)
    url, headers = store.presign_put(sha)
    answer = worker_client(worker).push(sha, len(data), url, headers)
    assert answer["status"] == 200 and answer["checksum"] == full_checksum(sha)
    assert store.confirm(sha, len(data)).checksum == full_checksum(sha)
    assert worker_client(worker).status()["pushes"] == {"shards": 1, "bytes": len(data)}


def test_a_url_presigned_for_other_bytes_stores_nothing(worker, server, bucket):
    store = ObjectStore(make_target(server.endpoint, bucket))
    data, other = os.urandom(200_000), os.urandom(200_000)
    sha = held_by(worker, data)
    wrong = hashlib.sha256(other).hexdigest()
    url, headers = store.presign_put(wrong)  # the store expects other's SHA-256 under that key
    answer = worker_client(worker).push(sha, len(data), url, headers)
    assert answer["status"] == 400 and "BadDigest" in answer["error"]
    with pytest.raises(ObjectMissing):
        store.head(wrong)
    assert worker_client(worker).status()["pushes"] == {}


def test_a_push_is_refused_before_anything_is_sent(worker, server, bucket):
    store = ObjectStore(make_target(server.endpoint, bucket))
    data = os.urandom(1000)
    sha = held_by(worker, data)
    url, headers = store.presign_put(sha)
    client = worker_client(worker)
    for bad_url, bad_headers, size in (
            ("file:///etc/passwd", headers, len(data)),
            (url, {**headers, "Host": "elsewhere"}, len(data)),
            (url, {**headers, "x-amz-meta-a": "b\r\nX-Injected: 1"}, len(data)),
            (url, {**headers, "x-amz-a:b": "c"}, len(data)),
            (url, {**headers, "x-amz-a b": "c"}, len(data)),
            (url, headers, len(data) + 1)):
        with pytest.raises(WorkerError) as refused:
            client.push(sha, size, bad_url, bad_headers)
        assert refused.value.status in (400, 409)
    with pytest.raises(ObjectMissing):
        store.head(sha)
