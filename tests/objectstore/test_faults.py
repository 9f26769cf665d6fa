"""Each fault of an object store is one clear error, and says whether a job waits: a missing
bucket, an unreachable endpoint, wrong or missing credentials (against the real SeaweedFS), and
throttling and 5xx answers (through a front that injects them), retried with backoff."""
from __future__ import annotations

import hashlib

import pytest

from bench.seaweed import SECRET_KEY, free_port
from pipeline.errors import (
    BucketMissing,
    ObjectStoreError,
    StoreCredentials,
    StoreServerError,
    StoreThrottled,
    StoreUnreachable,
)
from pipeline.objectstore.client import ObjectStore
from tests.objectstore.conftest import FlakyFront, make_target

SHA = hashlib.sha256(b"shard").hexdigest()


@pytest.fixture
def shard(tmp_path):
    p = tmp_path / "shard"
    p.write_bytes(b"shard")
    return p


def every_operation(store: ObjectStore, shard, tmp_path):
    return {"put": lambda: store.put(SHA, shard), "confirm": lambda: store.confirm(SHA, 5),
            "get": lambda: store.get(SHA, tmp_path / "out", size=5), "read back": lambda: store.read_back(SHA, 5),
            "inventory": lambda: list(store.inventory()), "delete": lambda: store.delete(SHA)}


def test_a_missing_bucket_is_one_error_for_every_operation_and_jobs_wait(server, aws_env, shard, tmp_path):
    store = ObjectStore(make_target(server.endpoint, "no-such-bucket"))
    for name, op in every_operation(store, shard, tmp_path).items():
        with pytest.raises(BucketMissing, match="bucket does not exist") as e:
            op()
        assert e.value.wait, name


def test_an_endpoint_with_nothing_listening_is_unreachable(aws_env, shard, tmp_path):
    store = ObjectStore(make_target(f"http://127.0.0.1:{free_port()}", "bucket", max_attempts=2, connect_timeout=2))
    for name, op in every_operation(store, shard, tmp_path).items():
        with pytest.raises(StoreUnreachable, match="unreachable") as e:
            op()
        assert e.value.wait, name


def test_wrong_credentials_say_where_they_came_from_and_never_show_the_secret(server, bucket, monkeypatch, shard):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = ObjectStore(make_target(server.endpoint, bucket))
    with pytest.raises(StoreCredentials, match=r"credentials refused .*the environment \(AWS_ACCESS_KEY_ID") as e:
        store.put(SHA, shard)
    assert e.value.wait and "not-the-secret" not in str(e.value) and SECRET_KEY not in str(e.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unknown-key")
    with pytest.raises(StoreCredentials, match="credentials were refused"):  # a HEAD's 403 has no code to tell
        ObjectStore(make_target(server.endpoint, bucket)).confirm(SHA, 5)


def test_a_profile_that_does_not_exist_and_no_credentials_at_all_are_named(server, bucket, monkeypatch, shard):
    with pytest.raises(StoreCredentials, match="profile 'nightly' is in neither"):
        ObjectStore(make_target(server.endpoint, bucket, profile="nightly")).put(SHA, shard)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoreCredentials, match="no credentials were found"):
        ObjectStore(make_target(server.endpoint, bucket)).put(SHA, shard)


def test_a_profile_from_the_shared_credentials_file_is_used(server, bucket, monkeypatch, tmp_path, shard):
    creds = tmp_path / "credentials"
    creds.write_text(f"[nightly]\naws_access_key_id = ckpt-test-access\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = ObjectStore(make_target(server.endpoint, bucket, profile="nightly"))
    store.put(SHA, shard)
    store.confirm(SHA, 5)


@pytest.mark.parametrize(("status", "code", "error"), [(503, "SlowDown", StoreThrottled),
                                                       (500, "InternalError", StoreServerError)])
def test_throttling_and_server_errors_are_retried_with_backoff_then_reported(server, bucket, shard, status, code,
                                                                            error):
    front = FlakyFront(server.ports["s3.port"], status, code, failures=2)
    try:
        store = ObjectStore(make_target(front.endpoint, bucket, max_attempts=4))  # botocore's default is 3
        store.put(SHA, shard)  # two failures, then through on the third attempt
        assert front.seen == 2
        store.confirm(SHA, 5)
        front.failures = 100
        with pytest.raises(error, match="4 attempts") as e:
            store.confirm(SHA, 5)
        assert front.seen == 2 + 4 and e.value.wait
    finally:
        front.close()


def test_every_fault_is_an_object_store_error_carrying_the_target_name(server, aws_env, shard):
    store = ObjectStore(make_target(server.endpoint, "no-such-bucket", name="cold"))
    with pytest.raises(ObjectStoreError, match="^object store cold: ") as e:
        store.put(SHA, shard)
    assert e.value.target == "cold"
