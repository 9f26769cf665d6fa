"""The object-store client against a real S3 server (SeaweedFS on loopback): put, confirm, get,
read back, inventory, delete, resumable multipart uploads, tampered and truncated objects."""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipeline.errors import ObjectMismatch, ObjectMissing
from pipeline.objectstore import keys
from pipeline.objectstore.client import ObjectStore
from tests.objectstore.conftest import make_target, raw_client

MiB = 2**20


def source(tmp_path: Path, size: int, seed: int = 0) -> tuple[Path, str, bytes]:
    data = random.Random(seed).randbytes(size)
    path = tmp_path / f"src-{seed}-{size}"
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest(), data


def count_calls(store: ObjectStore) -> Counter:
    calls: Counter = Counter()
    store.s3.meta.events.register("before-call.s3.*", lambda model, **_: calls.update([model.name]))
    return calls


def test_small_shard_is_one_put_carrying_its_sha256_and_confirmed_by_the_stores_checksum(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    calls = count_calls(store)
    path, sha, data = source(tmp_path, 1000)
    stored = store.put(sha, path)
    assert calls["PutObject"] == 1 and calls["CreateMultipartUpload"] == 0
    assert stored.key == f"ckpt/{sha[:2]}/{sha}" and stored.checksum == keys.full_checksum(sha)
    head = raw_client(server).head_object(Bucket=bucket, Key=stored.key, ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == keys.full_checksum(sha)  # the store keeps the SHA-256 it checked
    assert store.confirm(sha, 1000) == stored
    out = tmp_path / "out"
    assert store.get(sha, out) == 1000 and out.read_bytes() == data


def test_a_byte_range_of_a_file_is_put_as_its_own_object(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    path, _, data = source(tmp_path, 3000)
    piece = data[1000:2500]
    sha = hashlib.sha256(piece).hexdigest()
    store.put(sha, path, offset=1000, length=1500)
    store.confirm(sha, 1500)
    out = tmp_path / "out"
    store.get(sha, out)
    assert out.read_bytes() == piece


def test_large_shard_is_multipart_with_part_checksums_and_confirmed_by_its_composite(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    calls = count_calls(store)
    size = 12 * MiB + 5
    path, sha, data = source(tmp_path, size)
    stored = store.put(sha, path)
    assert calls["CreateMultipartUpload"] == 1 and calls["UploadPart"] == 3 and calls["PutObject"] == 0
    parts = [hashlib.sha256(data[o:o + 5 * MiB]).digest() for o in range(0, size, 5 * MiB)]
    assert stored.checksum == keys.composite(parts) and stored.checksum.endswith("-3")
    head = raw_client(server).head_object(Bucket=bucket, Key=stored.key, ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"] == stored.checksum  # the store's own composite, not just ours
    assert store.confirm(sha, size, stored.checksum) == stored
    with pytest.raises(ObjectMismatch, match="composite"):
        store.confirm(sha, size, keys.composite(parts[:2]))
    with pytest.raises(ObjectMismatch, match="composite"):
        store.confirm(sha, size)  # a composite cannot be checked against the name alone
    out = tmp_path / "out"
    assert store.get(sha, out) == size and out.read_bytes() == data
    assert calls["GetObject"] == 3  # one ranged GET per part


def test_a_source_that_is_not_the_bytes_its_name_says_is_refused_and_leaves_nothing(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    small, _, _ = source(tmp_path, 1000)
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(ObjectMismatch, match="BadDigest"):
        store.put(wrong, small)  # the store checks the checksum: the name
    big, _, _ = source(tmp_path, 11 * MiB)
    with pytest.raises(ObjectMismatch, match="not its name"):
        store.put(wrong, big)  # every part matches its own checksum: the whole is hashed here
    s3 = raw_client(server)
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")  # aborted, not left to bill


def test_an_interrupted_multipart_upload_is_continued_not_restarted(server, bucket, tmp_path):
    size = 30 * MiB
    path, sha, data = source(tmp_path, size)
    points = tmp_path / "failpoints"
    points.mkdir()
    (points / "objectstore.part_sent").write_text("kill\n")
    script = ("import sys; from pathlib import Path; from pipeline.objectstore.client import ObjectStore;"
              "from tests.objectstore.conftest import make_target;"
              f"ObjectStore(make_target({server.endpoint!r}, {bucket!r}, concurrency=1))"
              f".put({sha!r}, Path({str(path)!r}))")
    env = {**os.environ, "CKPT_FAILPOINTS": str(points), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    crashed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert crashed.returncode == -9, crashed.stderr.decode()[-2000:]  # killed right after its first part
    s3 = raw_client(server)
    uploads = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]
    kept = s3.list_parts(Bucket=bucket, Key=uploads[0]["Key"], UploadId=uploads[0]["UploadId"])["Parts"]
    assert len(uploads) == 1 and len(kept) == 1

    store = ObjectStore(make_target(server.endpoint, bucket))
    calls = count_calls(store)
    stored = store.put(sha, path)
    assert calls["CreateMultipartUpload"] == 0 and calls["UploadPart"] == 6 - len(kept)
    store.confirm(sha, size, stored.checksum)
    out = tmp_path / "out"
    store.get(sha, out)
    assert out.read_bytes() == data
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_a_tampered_object_fails_confirm_get_and_read_back(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    path, sha, data = source(tmp_path, 2000)
    stored = store.put(sha, path)
    s3 = raw_client(server)
    other = bytes(255 - b for b in data)
    s3.put_object(Bucket=bucket, Key=stored.key, Body=other)  # same length, other bytes, no SHA-256
    with pytest.raises(ObjectMismatch, match="no SHA-256"):
        store.confirm(sha, 2000)
    out = tmp_path / "out"
    with pytest.raises(ObjectMismatch, match="not their name"):
        store.get(sha, out)
    assert not out.exists()  # bad bytes are never left where a restore would take them
    with pytest.raises(ObjectMismatch, match="not their name"):
        store.read_back(sha, 2000)
    s3.put_object(Bucket=bucket, Key=stored.key, Body=other, ChecksumAlgorithm="SHA256")  # with its own checksum
    with pytest.raises(ObjectMismatch, match="is not"):
        store.confirm(sha, 2000)


def test_a_truncated_object_fails_confirm_and_even_a_sampled_read_back(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    size = 12 * MiB
    path, sha, data = source(tmp_path, size)
    stored = store.put(sha, path)
    raw_client(server).put_object(Bucket=bucket, Key=stored.key, Body=data[:size - 100])
    with pytest.raises(ObjectMismatch, match="bytes, expected"):
        store.confirm(sha, size, stored.checksum)
    with pytest.raises(ObjectMismatch, match="expected"):
        store.read_back(sha, size, sample=0.1, seed=1)


def read_all(stream, block: int) -> bytes:
    out, view = bytearray(), memoryview(bytearray(block))
    while n := stream.readinto(view):
        out += view[:n]
    return bytes(out)


def test_open_reads_an_object_in_order_with_its_ranges_fetched_ahead_in_a_bounded_window(
        server, bucket, tmp_path, monkeypatch):
    from pipeline.objectstore import download

    store = ObjectStore(make_target(server.endpoint, bucket))  # 5 MiB parts, concurrency 10
    size = 4 * 5 * MiB + 12345
    path, sha, data = source(tmp_path, size, seed=7)
    store.put(sha, path)
    monkeypatch.setattr(download, "CHUNK", 256 * 1024)  # each range arrives in several pieces
    monkeypatch.setattr(download, "READ_AHEAD", 2 * 5 * MiB)  # two ranges held at most
    running, most = 0, 0
    real_fetch = download.fetch

    def counted(*args, **kwargs):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            return real_fetch(*args, **kwargs)
        finally:
            running -= 1

    monkeypatch.setattr(download, "fetch", counted)
    stream = store.open(sha, size)
    try:
        assert read_all(stream, 3 * MiB + 7) == data  # blocks that straddle the ranges
    finally:
        stream.close()
    assert most == 2
    assert read_all(store.open(sha, size), 4 * MiB) == data  # the default window


def test_open_of_an_absent_or_shorter_object_fails_on_the_read_that_reaches_it(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    path, sha, data = source(tmp_path, 6 * MiB, seed=8)
    with pytest.raises(ObjectMissing):
        read_all(store.open(sha, len(data)), MiB)
    stored = store.put(sha, path)
    raw_client(server).put_object(Bucket=bucket, Key=stored.key, Body=data[:-100])
    with pytest.raises(ObjectMismatch, match="expected"):
        read_all(store.open(sha, len(data)), MiB)
    empty = hashlib.sha256(b"").hexdigest()
    with pytest.raises(ObjectMissing):
        store.open(empty, 0)
    (tmp_path / "nothing").write_bytes(b"")
    store.put(empty, tmp_path / "nothing")
    assert read_all(store.open(empty, 0), MiB) == b""


def test_read_back_reads_all_or_a_sample_with_the_first_and_last_ranges(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    size = 26 * MiB
    path, sha, _ = source(tmp_path, size)
    store.put(sha, path)
    calls = count_calls(store)
    ranges: list[str] = []
    store.s3.meta.events.register("before-call.s3.GetObject",
                                  lambda params, **_: ranges.append(params["headers"]["Range"]))
    assert store.read_back(sha, size) == size
    assert calls["GetObject"] == 6
    ranges.clear()
    read = store.read_back(sha, size, sample=0.3, seed=7)
    assert len(ranges) == 2 and read == 5 * MiB + 1 * MiB  # ceil(0.3 * 6) = 2: the first and the last
    assert ranges[0] == f"bytes=0-{5 * MiB - 1}" and ranges[-1] == f"bytes={25 * MiB}-{size - 1}"


def test_inventory_pages_through_the_listing_and_names_only_shards(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    shas = {}
    for i in range(5):
        path, sha, _ = source(tmp_path, 100 + i, seed=i)
        store.put(sha, path)
        shas[sha] = 100 + i
    s3 = raw_client(server)
    s3.put_object(Bucket=bucket, Key="ckpt/not-a-shard", Body=b"x")
    s3.put_object(Bucket=bucket, Key="elsewhere/ab/" + "ab" * 32, Body=b"x")
    s3.put_object(Bucket=bucket, Key="ckpt/zz/" + "ab" * 32, Body=b"x")  # not under its fan-out directory
    calls = count_calls(store)
    listed = {o.sha256: o.size for o in store.inventory(page_size=2)}
    assert listed == shas
    assert calls["ListObjectsV2"] >= 4  # 7 keys under the prefix, 2 a page
    assert store.used_bytes() == sum(shas.values())


def test_delete_removes_the_object_and_deleting_again_is_done(server, bucket, tmp_path):
    store = ObjectStore(make_target(server.endpoint, bucket))
    path, sha, _ = source(tmp_path, 500)
    store.put(sha, path)
    store.delete(sha)
    with pytest.raises(ObjectMissing):
        store.head(sha)
    store.delete(sha)
    assert list(store.inventory()) == []
