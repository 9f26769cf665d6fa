"""Chain replication between real storage worker processes on loopback (workers/chain.py):
one upload, passed on by each worker to the next as it arrives."""
from __future__ import annotations

import hashlib
import os

import pytest

from pipeline.cluster import auth
from pipeline.cluster.client import shard_path
from pipeline.errors import WorkerError
from tests.processes import KEY, StorageWorker, base_env, storage_workers, worker_client
from tests.unit.test_storage_worker import raw_request


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    with storage_workers(tmp_path_factory.mktemp("chain"), 3) as ws:
        yield ws


client = worker_client


def upload(tmp_path, first: StorageWorker, chain, data: bytes, name: str | None = None) -> tuple[str, dict]:
    src = tmp_path / "src"
    src.write_bytes(data)
    name = name or hashlib.sha256(data).hexdigest()
    return name, client(first).put_range(name, b"", str(src), 0, len(data),
                                         chain=[(w.node_id, w.url) for w in chain])


def test_one_upload_reaches_every_worker_of_the_chain_byte_for_byte(three, tmp_path):
    data = os.urandom(5_000_000)
    name, answer = upload(tmp_path, three[0], three[1:], data)
    assert answer["created"] is True
    assert [(r["node"], r["ok"], r["created"]) for r in answer["chain"]] == [
        (three[1].node_id, True, True), (three[2].node_id, True, True)]
    for w in three:
        assert w.shard(name).read_bytes() == data
    # Sent again: every worker already holds it, and says so; nothing is written twice.
    _, again = upload(tmp_path, three[0], three[1:], data)
    assert again["created"] is False and [r["created"] for r in again["chain"]] == [False, False]


def test_a_chain_past_a_worker_that_already_holds_it_still_reaches_the_next(three, tmp_path):
    data = os.urandom(300_000)
    name = hashlib.sha256(data).hexdigest()
    src = tmp_path / "only-first"
    src.write_bytes(data)
    client(three[0]).put_range(name, b"", str(src), 0, len(data))
    _, answer = upload(tmp_path, three[0], three[1:], data)
    assert answer["created"] is False and all(r["ok"] and r["created"] for r in answer["chain"])
    assert three[2].shard(name).read_bytes() == data


def test_bytes_that_do_not_match_their_name_are_refused_by_every_hop(three, tmp_path):
    wrong = "cd" * 32
    with pytest.raises(WorkerError, match="422") as info:
        upload(tmp_path, three[0], three[1:], os.urandom(200_000), name=wrong)
    assert info.value.status == 422
    assert all(client(w).head(wrong) is None for w in three)


def test_a_dead_hop_fails_only_itself_and_what_comes_after_it(three, tmp_path):
    gone = StorageWorker(tmp_path / "gone", base_env(tmp_path / "home"), tmp_path / "gone.log").start()
    gone_id = gone.node_id
    gone.stop()
    data = os.urandom(400_000)
    name = hashlib.sha256(data).hexdigest()
    src = tmp_path / "src"
    src.write_bytes(data)
    answer = client(three[0]).put_range(name, b"", str(src), 0, len(data),
                                        chain=[(gone_id, gone.url), (three[2].node_id, three[2].url)])
    assert answer["created"] is True and three[0].shard(name).read_bytes() == data
    first, second = answer["chain"]
    assert (first["node"], first["ok"]) == (gone_id, False) and "not reached" in first["error"]
    assert (second["node"], second["ok"]) == (three[2].node_id, False) and "before it" in second["error"]
    assert client(three[2]).head(name) is None


def test_a_hop_without_the_cluster_key_gets_nothing_it_can_pass_for_stored(three, tmp_path):
    stranger = StorageWorker(tmp_path / "s", base_env(tmp_path / "h2", CKPT_CLUSTER_KEY="another-key"),
                             tmp_path / "s.log", key="another-key").start()
    try:
        data = os.urandom(100_000)
        name, answer = upload(tmp_path, three[0], [stranger], data)
        (hop,) = answer["chain"]
        assert hop["ok"] is False and "401" in hop["error"]  # it refused our signature: nothing stored
        assert not stranger.shard(name).exists()
    finally:
        stranger.stop()


def test_the_chain_is_signed_and_cannot_name_the_worker_itself(three, tmp_path):
    w = three[0]
    data = b"x" * 1000
    name = hashlib.sha256(data).hexdigest()
    # Signed for a plain upload, sent with a chain appended: the signature no longer matches.
    headers = auth.sign(KEY.encode(), "PUT", shard_path(name), node=w.node_id)
    status, _ = raw_request(w, "PUT", shard_path(name, [(three[1].node_id, three[1].url)]),
                            {**headers, "Content-Length": str(len(data))}, data)
    assert status == 401
    with pytest.raises(WorkerError, match="400.*names this worker"):
        upload(tmp_path, w, [three[1], w], data)
    with pytest.raises(WorkerError, match="400.*not <node id>@http"):
        client(w).put_range(name, b"", str(tmp_path / "src"), 0, 0, chain=[("n", "ftp://x")])
