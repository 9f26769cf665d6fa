"""Attack: rotation's last confirmation on an object store asked the size only.

Before a local checkpoint is deleted, rotation asks each store holding a counted copy whether it
still holds it (pipeline/store/rotation.py ``confirm_with_workers`` -> ``client_for(...).stat``).
On an object store that was a HEAD answered by its size: an object overwritten after its confirm
by another writer, same length, other bytes (and no SHA-256, or another one), still "held" it, so
``target_mode = "required"`` let the local copy go on a bucket copy that is not the checkpoint's
bytes. The store's own checksum answers that, in the same HEAD (real SeaweedFS).
"""
from __future__ import annotations

import base64
import hashlib

from pipeline.objectstore.client import ObjectStore
from pipeline.objectstore.tier import TargetClient
from tests.objectstore.conftest import make_target, raw_client
from tests.objectstore.test_client import source


def test_rotation_does_not_confirm_an_object_overwritten_with_other_bytes(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    path, sha, data = source(tmp_path, 2000)
    stored = store.put(sha, path)
    client = TargetClient(store)
    assert client.stat([sha]) == {sha: 2000}

    other = bytes(255 - b for b in data)
    s3 = raw_client(server)
    s3.put_object(Bucket=bucket, Key=stored.key, Body=other)  # same length, no SHA-256
    assert client.stat([sha]) == {sha: None}

    s3.put_object(Bucket=bucket, Key=stored.key, Body=other,  # same length, its own SHA-256
                  ChecksumSHA256=base64.b64encode(hashlib.sha256(other).digest()).decode())
    assert client.stat([sha]) == {sha: None}
