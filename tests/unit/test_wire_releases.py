"""Compression on the wire across releases (pipeline/cluster/wire.py): hosts are upgraded one
at a time, so workers and senders of the previous release meet this one's. The previous
release is its own code, not an imitation: its tree, taken out of git at the commit before
planes frames went on the wire, runs as real storage worker processes and as a sender (a
subprocess), against this release's on loopback (a link taken to be between two hosts)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pipeline.cluster.client as client_mod
from pipeline.cluster import decoding, wire
from pipeline.errors import ConfigError, WorkerError
from pipeline.settings import load
from tests.processes import StorageWorker, base_env, worker_client
from tests.unit.test_wire import received, remote, sent, upload, weights  # noqa: F401  (fixtures)

#: The previous release: main before planes frames went on the wire (zstd frames under ?zstd=).
PREVIOUS_RELEASE = "1c6d8bb19e45a930dd11c3410cfba8ed2a0808c5"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """The previous release's source tree."""
    tree = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, "pipeline", "workers", "webui"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree




@pytest.fixture(scope="module")
def mixed(tmp_path_factory, previous):
    """Workers 0 and 2 of this release, worker 1 of the previous one, one cluster key."""
    tmp = tmp_path_factory.mktemp("mixed")
    ws: list[StorageWorker] = []
    try:
        for i, code in enumerate((None, previous, None)):
            # compressing whatever its cores' load: a download asked compressed is answered so
            env = base_env(tmp / "home", CKPT_WIRE_COMPRESSION="on")
            ws.append(StorageWorker(tmp / f"d{i}", env, tmp / f"w{i}.log", code=code))
            ws[-1].start()
        yield ws
    finally:
        for w in ws:
            w.stop()


def test_the_workers_say_what_they_decode(mixed):
    """This release names its codecs; the previous one names none and counts zstd frames."""
    new, old = worker_client(mixed[0]).status(), worker_client(mixed[1]).status()
    assert new["decodes"] == ["planes", "zstd"] and wire.announced(new) == ("planes", "zstd")
    assert "decodes" not in old and wire.announced(old) == ("zstd",)
    assert worker_client(mixed[1]).decodes() == ("zstd",)


def test_a_worker_of_the_previous_release_is_sent_zstd_frames(mixed, tmp_path, remote, sent):  # noqa: F811
    data = weights(6_000_000, seed=40)
    name, answer = upload(tmp_path, mixed[1], data)
    assert answer["created"] is True and mixed[1].shard(name).read_bytes() == data
    ((codec, on_wire),) = sent
    assert codec == "zstd" and on_wire < 0.85 * len(data), (codec, on_wire / len(data))


def test_a_chain_through_a_worker_of_the_previous_release_is_sent_zstd_frames(mixed, tmp_path, remote,  # noqa: F811
                                                                             sent):  # noqa: F811
    """Frames are passed along a chain as they are: every hop must decode them."""
    data = weights(5_000_000, seed=41)
    before = [received(w) for w in mixed]
    name, answer = upload(tmp_path, mixed[0], data, chain=[(w.node_id, w.url) for w in mixed[1:]])
    assert [r["ok"] for r in answer["chain"]] == [True, True], answer
    for w in mixed:
        assert w.shard(name).read_bytes() == data
    assert [codec for codec, _ in sent] == ["zstd"]
    for w, (shards, raw, on_wire) in zip(mixed, before, strict=True):  # each hop got it compressed
        now = received(w)
        assert (now[0] - shards, now[1] - raw) == (1, len(data)) and now[2] - on_wire < 0.85 * len(data), now


def test_a_chain_of_this_release_is_sent_planes_frames(mixed, tmp_path, remote, sent):  # noqa: F811
    data = weights(5_000_000, seed=42)
    name, answer = upload(tmp_path, mixed[2], data, chain=[(mixed[0].node_id, mixed[0].url)])
    assert [r["ok"] for r in answer["chain"]] == [True]
    assert mixed[0].shard(name).read_bytes() == data
    assert [codec for codec, _ in sent] == ["planes"]


def test_a_host_set_to_the_previous_wire_sends_and_asks_zstd_frames_of_a_worker_of_this_release(
        mixed, tmp_path, remote, sent):  # noqa: F811
    """``wire_codec = "zstd"`` (Settings.wire_codecs): the previous default's wire, to compare
    with it in one box or to roll back to it, though every worker decodes planes frames."""
    data = weights(5_000_000, seed=44)
    src = tmp_path / "src"
    src.write_bytes(data)
    name = hashlib.sha256(data).hexdigest()
    codecs = load({"home": tmp_path}, environ={"CKPT_WIRE_CODEC": "zstd"}).wire_codecs
    assert codecs == ("zstd",)
    answer = worker_client(mixed[2]).put_range(name, b"", str(src), 0, len(data), chain=[(mixed[0].node_id,
                                                                                            mixed[0].url)],
                                                wire="auto", codecs=codecs)
    assert [r["ok"] for r in answer["chain"]] == [True] and mixed[0].shard(name).read_bytes() == data
    assert [codec for codec, _ in sent] == ["zstd"]
    conn, stream = worker_client(mixed[0]).open_shard(name, size=len(data), wire="auto", codecs=codecs)
    try:
        assert isinstance(stream, decoding.ZstdDecompressing), type(stream)
        assert stream.read() == data
        stream.finish()
    finally:
        conn.close()
    with pytest.raises(ConfigError, match="wire_codec must be one of planes, zstd"):
        load({"home": tmp_path}, environ={"CKPT_WIRE_CODEC": "lz4"})


def test_a_download_from_a_worker_of_the_previous_release_reads_its_zstd_frames(mixed, tmp_path, remote,  # noqa: F811
                                                                               sent):  # noqa: F811
    data = weights(5_000_000, seed=43)
    name, _ = upload(tmp_path, mixed[1], data, wire_mode="off")
    for w, kind in ((mixed[1], decoding.ZstdDecompressing), (mixed[0], None)):
        if kind is None:  # a worker of this release, asked the same way: planes frames
            upload(tmp_path, w, data, wire_mode="off")
            kind = decoding.PlanesDecompressing
        conn, stream = worker_client(w).open_shard(name, size=len(data), wire="auto")
        try:
            assert isinstance(stream, kind), type(stream)
            assert stream.read() == data
            stream.finish()
        finally:
            conn.close()
        assert stream.wire < 0.85 * len(data)


SENDER = textwrap.dedent("""
    import hashlib, json, sys
    from pipeline.cluster import wire
    from pipeline.cluster.client import WorkerClient
    from pipeline.cluster.wire import Decompressing
    wire.same_host = lambda sock: False  # the worker is taken to be on another host
    url, key, node, src = sys.argv[1:5]
    data = open(src, "rb").read()
    name = hashlib.sha256(data).hexdigest()
    c = WorkerClient(url, key.encode(), node)
    answer = c.put_range(name, b"", src, 0, len(data), wire="on")
    conn, stream = c.open_shard(name, size=len(data), wire="on")
    got = stream.read()
    conn.close()
    print(json.dumps({"created": answer["created"], "compressed": isinstance(stream, Decompressing),
                      "same": got == data}))
""")


def test_a_sender_of_the_previous_release_uploads_and_downloads_in_zstd_frames(mixed, previous, tmp_path):
    """Its upload (``?zstd=``, zstd frames) is taken; its download (``?zstd=1``, no Accept) is
    answered in zstd frames, which it reads."""
    w = mixed[2]
    data = weights(6_000_000, seed=44)
    src = tmp_path / "src"
    src.write_bytes(data)
    before = worker_client(w).status()["zstd"]
    env = {**os.environ, "PYTHONPATH": str(previous)}
    run = subprocess.run([sys.executable, "-c", SENDER, w.url, w.key, w.node_id, str(src)], env=env, cwd=previous,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == {"created": True, "compressed": True, "same": True}
    assert w.shard(hashlib.sha256(data).hexdigest()).read_bytes() == data
    after = worker_client(w).status()["zstd"]
    crossed = after["received_wire"] - before.get("received_wire", 0)
    assert after["received_shards"] - before.get("received_shards", 0) == 1 and crossed < 0.85 * len(data)


def test_a_worker_rolled_back_to_the_previous_release_is_asked_again_after_one_refusal(tmp_path, previous,
                                                                                    remote, sent):  # noqa: F811
    """What a worker decodes is taken from its status for a while; one rolled back meanwhile
    refuses the planes frames it no longer reads, once, sent to it or through a chain to it:
    the next upload asks it again."""
    env = base_env(tmp_path / "home")
    first, w = (StorageWorker(tmp_path / f"d{i}", env, tmp_path / f"w{i}.log") for i in range(2))
    try:
        first.start(), w.start()
        data = weights(3_000_000, seed=45)
        upload(tmp_path, w, data)
        learned = client_mod._DECODES[w.url]
        assert learned[1] == ("planes", "zstd")
        w.stop()
        w.env, w.code = {**w.env, "PYTHONPATH": str(previous)}, previous  # same port, disk and node id
        w.start()  # (its start is awaited by asking its status: the rollback would be seen at once)
        client_mod._DECODES[w.url] = learned  # as if it was rolled back within DECODES_SECONDS
        with pytest.raises(WorkerError, match="411"):  # ?planes= means nothing to it: no Content-Length
            upload(tmp_path, w, data + b"1")
        name, answer = upload(tmp_path, w, data + b"2")
        assert answer["created"] and w.shard(name).read_bytes() == data + b"2"

        client_mod._DECODES[w.url] = learned  # once more, through a chain
        hop = [(w.node_id, w.url)]
        _, answer = upload(tmp_path, first, data + b"3", chain=hop)
        assert answer["chain"][0]["status"] == 411, answer
        name, answer = upload(tmp_path, first, data + b"4", chain=hop)
        assert answer["chain"][0]["ok"] and w.shard(name).read_bytes() == data + b"4"
        assert [codec for codec, _ in sent] == ["planes", "planes", "zstd", "planes", "zstd"]
    finally:
        first.stop()
        w.stop()


@pytest.mark.parametrize(("workers", "codec"), [
    ([("planes", "zstd")], "planes"),
    ([("planes", "zstd"), ("zstd",), ("planes", "zstd")], "zstd"),  # a chain through the previous release
    ([("zstd",), ()], None),  # through a worker older still: bytes as they are
    ([()], None),  # it could not say
])
def test_the_codec_of_an_upload_is_the_best_every_hop_decodes(workers, codec):
    assert wire.common_codec(iter(workers)) == codec  # asked one worker at a time, as put_range does


@pytest.mark.parametrize(("accept", "codec"), [
    ("application/x-ckpt-planes, application/zstd", "planes"),
    ("application/zstd;q=1, application/x-ckpt-planes;q=0.5", "planes"),  # this worker's order: the best first
    ("application/zstd", "zstd"), ("", "zstd"), ("*/*", "zstd"),  # the previous release names none
])
def test_a_download_is_answered_in_the_best_codec_the_client_accepts(accept, codec):
    assert wire.accepted(accept) == codec
