"""Rebuilding a file from shards on real storage worker processes: the file's SHA-256
covers every byte written; a replica that sends wrong bytes is found and skipped."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from pipeline.cluster.client import WorkerClient
from pipeline.errors import RestoreError
from pipeline.restore.gather import FileSource, ShardSource
from pipeline.restore.rebuild import write_file
from tests.processes import KEY, StorageWorker, base_env

CHUNK = 3_000_000


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rebuild")
    ws = []
    try:
        for i in range(2):
            ws.append(StorageWorker(tmp / f"w{i}", base_env(tmp / "home"), tmp / f"w{i}.log").start())
        yield ws
    finally:
        for w in ws:
            w.stop()


@pytest.fixture
def stored(workers, tmp_path):
    """A file of one shard with its own header (as a safetensors shard has) and three raw
    chunks, every shard on both workers (worker 0 first), and its bytes."""
    data = os.urandom(4 * CHUNK - 12345)
    src = tmp_path / "source"
    src.write_bytes(data)
    shards = []
    for seq, off in enumerate(range(0, len(data), CHUNK)):
        length = min(CHUNK, len(data) - off)
        header = b"HEADER-OF-THE-SHARD" if seq == 0 else b""
        sha = hashlib.sha256(header + data[off:off + length]).hexdigest()
        for w in workers:
            WorkerClient(w.url, KEY.encode(), w.node_id).put_range(sha, header, str(src), off, length)
        shards.append(ShardSource(sha, len(header) + length, "chunk", off, length, len(header),
                                  tuple((w.node_id, w.url) for w in workers)))
    f = FileSource("", len(data), hashlib.sha256(data).hexdigest(), "raw", tuple(shards))
    return f, data


def damage(worker: StorageWorker, sha: str, how: str) -> Path:
    path = worker.shard(sha)
    backup = path.with_name(path.name + ".good")
    os.chmod(path.parent, 0o755)
    os.replace(path, backup)
    raw = bytearray(backup.read_bytes())
    if how == "flip":
        raw[len(raw) // 2] ^= 0x01
    else:
        del raw[-1000:]
    path.write_bytes(bytes(raw))
    return backup


def rebuild(f: FileSource, out: Path) -> int:
    done = []
    write_file(f, out, KEY.encode(), done.append)
    return sum(done)


def test_intact_replicas_rebuild_the_file(stored, tmp_path):
    f, data = stored
    assert rebuild(f, tmp_path / "out") == len(data)
    assert (tmp_path / "out").read_bytes() == data


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_replica_with_wrong_bytes_is_skipped(stored, workers, tmp_path, caplog, how):
    f, data = stored
    bad = f.shards[2].sha256
    backup = damage(workers[0], bad, how)
    try:
        with caplog.at_level(logging.WARNING):
            assert rebuild(f, tmp_path / "out") == len(data)  # progress counts each byte once
    finally:
        os.replace(backup, workers[0].shard(bad))
    assert (tmp_path / "out").read_bytes() == data
    fallbacks = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(fallbacks) == 1 and workers[0].node_id in fallbacks[0] and bad[:12] in fallbacks[0]
    # A flipped bit only shows in the file's hash: the file is rebuilt once more, checking
    # every shard. A short replica is skipped on the first pass.
    rebuilt = [r for r in caplog.records if "checking every shard" in r.getMessage()]
    assert len(rebuilt) == (1 if how == "flip" else 0)


def test_no_intact_replica_fails_without_leaving_a_wrong_file_claimed(stored, workers, tmp_path):
    f, _ = stored
    bad = f.shards[1].sha256
    backups = [damage(w, bad, "flip") for w in workers]
    try:
        with pytest.raises(RestoreError, match=f"no healthy copy of shard {bad[:12]}"):
            rebuild(f, tmp_path / "out")
    finally:
        for w, b in zip(workers, backups, strict=True):
            os.replace(b, w.shard(bad))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_load_state_dict_fetch_checks_each_shard_and_skips_a_bad_replica(stored, workers, how):
    """load_state_dict keeps what it receives as tensors, with no file hash behind it: each
    shard's own SHA-256 must be checked (docs/design.md, invariant 4)."""
    from pipeline.restore.loader import _fetch_bytes

    f, data = stored
    shard = f.shards[0]  # the one with its own header
    backup = damage(workers[0], shard.sha256, how)
    try:
        got = _fetch_bytes(shard, KEY.encode())
    finally:
        os.replace(backup, workers[0].shard(shard.sha256))
    assert bytes(got[shard.payload_offset:]) == data[:shard.length]
    assert hashlib.sha256(got).hexdigest() == shard.sha256


def test_load_state_dict_fetch_with_no_intact_replica_fails(stored, workers):
    from pipeline.restore.loader import _fetch_bytes

    f, _ = stored
    shard = f.shards[3]
    backups = [damage(w, shard.sha256, "flip") for w in workers]
    try:
        with pytest.raises(RestoreError, match=f"no healthy copy of shard {shard.sha256[:12]}"):
            _fetch_bytes(shard, KEY.encode())
    finally:
        for w, b in zip(workers, backups, strict=True):
            os.replace(b, w.shard(shard.sha256))
