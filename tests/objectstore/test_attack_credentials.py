"""Attack: credentials renewed where the error says, while ``ckpt up`` runs.

A refused key gives one clear error: "the credentials came from ~/.aws/credentials for profile
...: check or renew them there ... jobs wait meanwhile". A long-running process keeps one
ObjectStore (one botocore client) per target, and botocore reads the shared credentials file
once, when the client is built: renewed keys were never read, every job waited until a restart
(real SeaweedFS with an identity: only its key is accepted).
"""
from __future__ import annotations

import pytest

from bench import seaweed
from pipeline.errors import StoreCredentials
from pipeline.objectstore.client import ObjectStore
from tests.objectstore.conftest import make_target


def write_profile(path, key: str, secret: str) -> None:
    path.write_text(f"[ckpt]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")


def test_credentials_renewed_in_the_profile_are_used_without_a_restart(server, bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "credentials"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    write_profile(creds, seaweed.ACCESS_KEY, "an-expired-secret")
    store = ObjectStore(make_target(server.endpoint, bucket, profile="ckpt"))
    with pytest.raises(StoreCredentials, match="renew them there"):
        store.call("head", store.s3.head_bucket, Bucket=bucket)

    write_profile(creds, seaweed.ACCESS_KEY, seaweed.SECRET_KEY)  # renewed where the error said
    store.call("head", store.s3.head_bucket, Bucket=bucket)
