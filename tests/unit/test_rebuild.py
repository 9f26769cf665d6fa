"""Rebuilding a file from shards on real storage worker processes: the file's SHA-256
covers every byte written; a replica that sends wrong bytes is found and skipped."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest

from pipeline.cluster.client import WorkerClient
from pipeline.errors import RestoreError
from pipeline.restoring import rebuild as rebuild_mod
from pipeline.restoring.gather import FileSource, ShardSource
from pipeline.restoring.links import LINKS
from pipeline.restoring.rebuild import write_file
from tests.processes import KEY, StorageWorker, storage_workers

CHUNK = 3_000_000


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with storage_workers(tmp_path_factory.mktemp("rebuild"), 2) as ws:
        yield ws


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
def test_a_replica_with_wrong_bytes_is_skipped(stored, workers, tmp_path, caplog, monkeypatch, how):
    monkeypatch.setattr(rebuild_mod, "LOCAL_STREAMS", 1)  # one at a time: every shard from workers[0] first
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


def test_shards_come_from_every_worker_at_once(stored, workers, tmp_path, monkeypatch):
    """Each worker's link bounds its stream: the file's shards are fetched several at once,
    each from the copy whose worker has the fewest transfers open (both workers send at
    once, whatever order the manifest gives), and the file comes out the same."""
    import time

    lock, opened, now_open, most = threading.Lock(), [], [0], [0]
    real = WorkerClient.open_shard

    def slow_to_answer(self, name, **kwargs):  # a worker whose link is slow: every transfer takes a while
        with lock:
            opened.append((name, self.node))
            now_open[0] += 1
            most[0] = max(most[0], now_open[0])
        try:
            time.sleep(0.3)
            return real(self, name, **kwargs)
        finally:
            with lock:
                now_open[0] -= 1

    monkeypatch.setattr(WorkerClient, "open_shard", slow_to_answer)
    f, data = stored
    started = time.monotonic()
    assert rebuild(f, tmp_path / "out") == len(data)
    elapsed = time.monotonic() - started
    assert (tmp_path / "out").read_bytes() == data
    assert sorted(name for name, _ in opened) == sorted(sh.sha256 for sh in f.shards)  # each shard once
    # Two at a time (one per worker), not one after another: 4 shards in two rounds of 0.3 s.
    assert most[0] == 2 and elapsed < 0.3 * len(f.shards), (most, elapsed)
    assert {node for _, node in opened} == {w.node_id for w in workers}  # from both workers
    assert LINKS.open_count(workers[0].node_id) == LINKS.open_count(workers[1].node_id) == 0


def test_one_stream_per_worker_and_fewer_when_every_copy_is_on_this_host():
    from pipeline.restoring.rebuild import _streams

    def file_on(*urls: str, shards: int = 8) -> FileSource:
        copies = tuple((f"w-{i}", u) for i, u in enumerate(urls))
        return FileSource("", 0, "", "raw", tuple(ShardSource("", 0, "chunk", 0, 0, 0, copies) for _ in range(shards)))

    lan = [f"http://10.0.0.{i}:7070" for i in range(1, 7)]
    assert _streams(file_on(*lan)) == 4  # six workers on the LAN: four at once
    assert _streams(file_on(*lan[:3])) == 3 and _streams(file_on(*lan, shards=2)) == 2
    assert _streams(file_on("http://127.0.0.1:7001", "http://127.0.0.1:7002", "http://127.0.0.1:7003")) == 2
    assert _streams(file_on(lan[0])) == 1


def test_copies_are_chosen_by_the_fewest_open_transfers_then_by_rank_and_order():
    from pipeline.restoring.links import Links

    links = Links()
    copies = [("a", "http://a"), ("b", "http://b"), ("c", "http://c")]
    assert links.choose(copies, (0, 0, 0), set()) == copies[0]
    assert links.choose(copies, (0, 0, 0), set()) == copies[1]  # a is busy now
    assert links.choose(copies, (0, 0, 1), set()) == copies[0]  # c is a worse kind of copy (a down worker's)
    assert links.choose(copies, (0, 0, 0), {"a", "b"}) == copies[2]
    assert links.choose(copies, (0, 0, 0), {"a", "b", "c"}) is None
    with links.reading(copies, (0, 0, 0)) as turns:
        assert next(turns) == copies[1]  # a has two open, b and c one each: b comes first in the order
        assert links.open_count("b") == 2
        assert next(turns) == copies[2]  # b failed: given back, and the next least busy is c
        assert (links.open_count("b"), links.open_count("c")) == (1, 2)
    assert links.open_count("c") == 1  # given back when the caller stopped reading


def test_a_missing_copy_is_read_from_the_next(stored, workers, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(rebuild_mod, "LOCAL_STREAMS", 1)  # one at a time: every shard from workers[0] first
    f, data = stored
    gone = f.shards[1].sha256
    path = workers[0].shard(gone)
    aside = path.with_name(path.name + ".aside")
    os.chmod(path.parent, 0o755)
    os.replace(path, aside)
    try:
        with caplog.at_level(logging.WARNING):
            assert rebuild(f, tmp_path / "out") == len(data)
    finally:
        os.replace(aside, path)
    assert (tmp_path / "out").read_bytes() == data
    assert LINKS.open_count(workers[0].node_id) == 0


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
    from pipeline.restoring.loader import _fetch_bytes

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
    from pipeline.restoring.loader import _fetch_bytes

    f, _ = stored
    shard = f.shards[3]
    backups = [damage(w, shard.sha256, "flip") for w in workers]
    try:
        with pytest.raises(RestoreError, match=f"no healthy copy of shard {shard.sha256[:12]}"):
            _fetch_bytes(shard, KEY.encode())
    finally:
        for w, b in zip(workers, backups, strict=True):
            os.replace(b, w.shard(shard.sha256))
