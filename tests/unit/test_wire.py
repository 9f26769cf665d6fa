"""Shard bytes compressed on the wire (pipeline/cluster/wire.py), between real storage worker
processes on loopback: a link is taken to be between two hosts by patching ``same_host``."""
from __future__ import annotations

import hashlib
import http.client
import io
import os
import socket

import numpy as np
import pytest
import zstandard

from pipeline.cluster import auth, decoding, wire
from pipeline.cluster.client import Upload, WorkerClient, shard_path
from pipeline.cluster.wire import Meter, is_loopback
from pipeline.codec import frames as planes
from pipeline.core.header import TensorInfo, shard_header
from pipeline.errors import MalformedStream
from tests.processes import KEY, StorageWorker, storage_workers, worker_client


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    with storage_workers(tmp_path_factory.mktemp("wire"), 3) as ws:
        yield ws


@pytest.fixture
def remote(monkeypatch):
    """Every worker counts as on another host, this host's CPU as idle; this process has
    measured nothing yet."""
    monkeypatch.setattr(wire, "same_host", lambda sock: False)
    monkeypatch.setattr(wire.CPU, "idle", lambda: 1.0)
    monkeypatch.setattr(wire, "METER", Meter())
    import pipeline.cluster.client as client_mod
    import pipeline.restoring.gather as gather_mod

    monkeypatch.setattr(client_mod, "METER", wire.METER)
    monkeypatch.setattr(gather_mod, "METER", wire.METER)


@pytest.fixture
def sent(monkeypatch):
    """What each upload of this test put on its connection: (codec of its frames or None, bytes)."""
    uploads: list[list] = []
    real_init, real_send, real_sendfile = Upload.__init__, Upload.send, Upload.sendfile

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.counted = [self.codec, 0]
        uploads.append(self.counted)

    def send(self, data):
        self.counted[1] += len(data)
        real_send(self, data)

    def sendfile(self, f, offset, length):
        n = real_sendfile(self, f, offset, length)
        self.counted[1] += n
        return n

    monkeypatch.setattr(Upload, "__init__", init)
    monkeypatch.setattr(Upload, "send", send)
    monkeypatch.setattr(Upload, "sendfile", sendfile)
    return uploads


def weights(n_bytes: int, seed: int = 0) -> bytes:
    """bf16 weights as a trainer writes them: normal(0, 0.02), the top half of each float32."""
    x = np.random.default_rng(seed).normal(0, 0.02, n_bytes // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


client = worker_client


def upload(tmp_path, w: StorageWorker, data: bytes, header: bytes = b"", chain=(), wire_mode: str = "auto"):
    src = tmp_path / "src"
    src.write_bytes(data)
    name = hashlib.sha256(header + data).hexdigest()
    return name, client(w).put_range(name, header, str(src), 0, len(data), chain=chain, wire=wire_mode)


def download(w: StorageWorker, name: str, size: int) -> tuple[bytes, int]:
    """A shard asked compressed: its raw bytes, and the bytes that crossed."""
    conn, stream = client(w).open_shard(name, size=size, wire="auto")
    try:
        assert isinstance(stream, decoding.PlanesDecompressing)
        got = stream.read()
        stream.finish()
    finally:
        conn.close()
    return got, stream.wire


def test_weights_cross_compressed_and_are_stored_as_their_own_bytes(three, tmp_path, remote, sent):
    data = weights(9_000_000)
    name, answer = upload(tmp_path, three[0], data, header=b"HEADER")
    assert answer["created"] is True
    assert three[0].shard(name).read_bytes() == b"HEADER" + data  # on disk: the raw bytes
    ((zstd, on_wire),) = sent
    assert zstd and on_wire < 0.85 * len(data), on_wire / len(data)


def test_a_shard_of_bf16_tensors_crosses_split_by_its_own_header(three, tmp_path, remote, sent):
    """A shard of tensors is a safetensors file of its own (pipeline/core/planner.py): its
    upload and its download cross in frames split by the dtypes its header gives, under 0.69
    of its size (plain zstd: 0.78), and it is stored as its own bytes."""
    data = weights(9_000_000, seed=20)
    header = shard_header([TensorInfo("w", "BF16", (len(data) // 2,), 0, len(data))])
    name, _ = upload(tmp_path, three[0], data, header=header)
    assert three[0].shard(name).read_bytes() == header + data
    ((codec, on_wire),) = sent
    assert codec == "planes" and on_wire < 0.69 * len(header + data), on_wire / len(header + data)
    got, on_wire = download(three[0], name, len(header + data))
    assert got == header + data and on_wire < 0.69 * len(got), on_wire / len(got)


def received(w: StorageWorker) -> tuple[int, int, int]:
    z = client(w).status()["zstd"]
    return z.get("received_shards", 0), z.get("received_raw", 0), z.get("received_wire", 0)


def test_a_chain_passes_the_compressed_bytes_on_and_every_hop_stores_the_raw_ones(three, tmp_path, remote, sent):
    data = weights(6_000_000, seed=1)
    before = [received(w) for w in three]
    name, answer = upload(tmp_path, three[0], data, chain=[(w.node_id, w.url) for w in three[1:]])
    assert [r["ok"] for r in answer["chain"]] == [True, True]
    for w in three:
        assert w.shard(name).read_bytes() == data
    assert [codec for codec, _ in sent] == ["planes"]  # the hops forward the frames (their counts below)
    for w, (shards, raw, on_wire) in zip(three, before, strict=True):  # each says so in its status
        now = received(w)
        assert (now[0] - shards, now[1] - raw) == (1, len(data)) and now[2] - on_wire < 0.85 * len(data), now


def test_a_download_is_asked_compressed_and_read_back_raw(three, tmp_path, remote):
    data = weights(8_000_000, seed=2)
    name, _ = upload(tmp_path, three[1], data, wire_mode="off")
    got, on_wire = download(three[1], name, len(data))
    assert got == data and on_wire < 0.85 * len(data)


def test_what_does_not_compress_crosses_as_it_is(three, tmp_path, remote, sent):
    name, _ = upload(tmp_path, three[0], os.urandom(6_000_000))
    assert sent == [[None, 6_000_000]]
    assert three[0].shard(name).stat().st_size == 6_000_000


def test_a_worker_on_this_host_is_never_sent_compressed(three, tmp_path, sent):
    upload(tmp_path, three[0], weights(6_000_000, seed=3))
    assert sent == [[None, 6_000_000]]  # loopback: the compressor would only slow it down


def _chunked_put(w: StorageWorker, name: str, raw_len: str, frames: list[bytes],
                 query: str = "planes") -> tuple[int, bytes]:
    """A compressed upload sent by hand: the worker's answer, whenever it came."""
    path = shard_path(name) + f"?{query}={raw_len}"
    headers = {**auth.sign(KEY.encode(), "PUT", path, node=w.node_id), "Transfer-Encoding": "chunked"}
    sock = socket.create_connection(("127.0.0.1", w.port), timeout=30)
    try:
        sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: x\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n")
        try:
            for frame in frames:
                sock.sendall(b"%x\r\n" % len(frame) + frame + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it read the rest: its answer says why
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read()
    finally:
        sock.close()


@pytest.mark.parametrize("case", ["garbage", "corrupted", "more than declared", "less than declared", "a bomb",
                                  "not a length"])
def test_a_malformed_compressed_upload_is_refused_and_never_visible(three, case):
    """Nothing from the network is trusted (invariant 5): the worker decodes at most the
    declared length, checks the result's hash, and refuses anything else with a reason."""
    data = weights(2_000_000, seed=len(case))  # each case its own shard
    name = hashlib.sha256(data).hexdigest()
    corrupted = bytearray(planes.encode(data))
    corrupted[len(corrupted) // 2] ^= 0x40
    frames, length = {
        "garbage": ([planes.MAGIC + os.urandom(5000)], str(len(data))),
        "corrupted": ([bytes(corrupted)], str(len(data))),
        "more than declared": ([planes.encode(data), planes.encode(b"tail")], str(len(data))),
        "less than declared": ([planes.encode(data[:1_000_000])], str(len(data))),
        "a bomb": ([planes.encode(bytes(planes.MAX_RAW))], str(len(data))),  # 64 MiB of zeros in ~2 kB
        "not a length": ([], "2e6"),  # refused before any byte of the body is read
    }[case]
    status, body = _chunked_put(three[2], name, length, frames)
    assert status == 400, (status, body)
    assert client(three[2]).head(name) is None


@pytest.mark.parametrize("case", ["garbage", "more than declared", "less than declared", "a bomb", "planes",
                                  "both codecs"])
def test_a_malformed_zstd_upload_is_refused_and_never_visible(three, case):
    """The previous release's zstd frames are taken as carefully: at most the declared length
    decompressed, whatever the frames claim; planes frames declared as zstd are not zstd."""
    data = weights(2_000_000, seed=100 + len(case))
    name = hashlib.sha256(data).hexdigest()
    z = zstandard.ZstdCompressor(level=1)
    frames, query = {
        "garbage": ([b"\x28\xb5\x2f\xfd" + os.urandom(5000)], "zstd"),
        "more than declared": ([z.compress(data), z.compress(b"tail")], "zstd"),
        "less than declared": ([z.compress(data[:1_000_000])], "zstd"),
        "a bomb": ([z.compress(b"\0" * (256 << 20))], "zstd"),  # 256 MiB of zeros in ~8 kB
        "planes": ([planes.encode(data)], "zstd"),
        "both codecs": ([z.compress(data)], f"planes={len(data)}&zstd"),
    }[case]
    status, body = _chunked_put(three[2], name, str(len(data)), frames, query)
    assert status == 400, (status, body)
    assert client(three[2]).head(name) is None


def test_a_frame_claiming_more_than_is_left_is_refused_before_its_body_is_read():
    """A bomb (64 MiB of zeros in a 2 kB frame) declared as 1,000 bytes is cut at its tables:
    nothing of it is read on, let alone decoded."""
    frame = planes.encode(bytes(planes.MAX_RAW))
    body = io.BytesIO(frame)
    with pytest.raises(MalformedStream, match="at most 1,000"):
        decoding.PlanesDecompressing(body, 1000).read()
    assert body.tell() < 100 < len(frame)


def test_the_meter_compresses_only_links_slower_than_the_compressor(monkeypatch):
    monkeypatch.setattr(wire.CPU, "idle", lambda: 1.0)
    m = Meter()
    url = "http://10.0.0.2:7000"
    assert m.worth_it(url, "up")  # a link never measured: assumed slower than zstd
    m.compressed(8 << 20, 0.01)  # 800 MiB/s
    m.transfer(url, "up", 64 << 20, 64 << 20, 5.0)  # plain, 13 MiB/s: a 100 Mbit link
    assert m.worth_it(url, "up") and not m.worth_it(url, "up", ratio=0.95)
    assert m.worth_it(url, "down")  # each direction on its own
    fast = "http://10.0.0.3:7000"
    for _ in range(4):  # plain at 1.2 GB/s (10 GbE): faster than the compressor
        m.transfer(fast, "up", 1 << 30, 1 << 30, 0.9)
    assert not m.worth_it(fast, "up")
    m.transfer(url, "up", 64 << 20, 40 << 20, 4.0)  # compressed transfers teach the ratio
    assert 0.6 < m.ratio < 0.8
    m.transfer(url, "up", 1000, 10, 0.0001)  # too small to say anything
    assert m.rates[(url, "up")] < 20 << 20


def test_a_host_with_no_cores_to_spare_does_not_compress(monkeypatch):
    m = Meter()
    monkeypatch.setattr(wire.CPU, "idle", lambda: 0.2)  # a training host busy feeding its GPUs
    assert not m.worth_it("http://10.0.0.2:7000", "up")
    monkeypatch.setattr(wire.CPU, "idle", lambda: 0.5)
    assert m.worth_it("http://10.0.0.2:7000", "up")


def test_idle_cpu_is_read_from_the_host():
    cpu = wire.CpuIdle(every=0.05)
    cpu.idle()  # starts the sampler
    import time

    time.sleep(0.3)
    assert 0.0 <= cpu.idle() <= 1.0


def test_idle_cpu_counts_only_the_cpus_the_process_may_run_on():
    """A process confined to some CPUs (a container's cpuset, taskset) judges by them: busy
    CPUs it cannot use do not keep it from compressing, idle ones it cannot use do not let it."""
    stat = ("cpu  300 0 100 500 100 0 0 0 0 0\n"
            "cpu0 200 0 50 0 0 0 0 0 0 0\n"  # busy: 250 of 250
            "cpu1 100 0 50 500 100 0 0 0 0 0\n"  # 600 of 750 idle or waiting
            "intr 12345 0 0\nctxt 999\n")
    assert wire.cpu_times(stat, {1}) == (750, 600)
    assert wire.cpu_times(stat, {0}) == (250, 0)
    assert wire.cpu_times(stat, {0, 1}) == (1000, 600)
    with pytest.raises(ValueError):
        wire.cpu_times(stat, {7})


def test_a_busy_worker_answers_a_compressed_download_plain(tmp_path, monkeypatch):
    """Compression is asked for, not ordered: a worker with no cores to spare sends the shard
    as it is, and the client reads it as such."""
    import threading

    from werkzeug.serving import make_server

    import workers.app as app_mod
    from workers.app import WorkerApp
    from workers.shardstore import ShardStore

    monkeypatch.setattr(wire, "same_host", lambda sock: False)
    monkeypatch.setattr(wire.CPU, "idle", lambda: 1.0)  # the client's host: compress if it can
    store = ShardStore(str(tmp_path / "data"))
    data = weights(3_000_000, seed=9)
    name = hashlib.sha256(data).hexdigest()
    store.put(name, io.BytesIO(data), len(data))
    server = make_server("127.0.0.1", 0, WorkerApp(store, key=KEY.encode(), node_id="w-busy"), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        c = WorkerClient(f"http://127.0.0.1:{server.server_port}", KEY.encode(), "w-busy")
        for idle, compressed in ((0.1, False), (0.9, True)):
            monkeypatch.setattr(app_mod, "CPU", wire.CpuIdle())  # the worker's host, apart from the client's
            monkeypatch.setattr(app_mod.CPU, "idle", lambda idle=idle: idle)
            conn, stream = c.open_shard(name, size=len(data), wire="auto")
            try:
                assert isinstance(stream, decoding.PlanesDecompressing) is compressed
                assert stream.read() == data
            finally:
                conn.close()
    finally:
        server.shutdown()
        thread.join(10)


def test_on_compresses_between_hosts_whatever_the_load(three, tmp_path, remote, monkeypatch, sent):
    monkeypatch.setattr(wire.CPU, "idle", lambda: 0.0)  # every core busy: auto does not compress
    data = weights(2_000_000, seed=11)
    upload(tmp_path, three[0], data, wire_mode="auto")
    upload(tmp_path, three[1], data, wire_mode="on")
    (auto_codec, auto_wire), (on_codec, on_wire) = sent
    # auto sends raw frames (it would compress blocks if the cores freed meanwhile); on compresses
    assert auto_codec and auto_wire > len(data) and on_codec and on_wire < 0.85 * len(data)


def test_a_short_upload_that_starts_on_busy_cores_is_sent_as_it_is(three, tmp_path, remote, monkeypatch, sent):
    """Raw frames pay off only if the cores free up while the upload lasts: one that should
    take less than ``BUSY_START_SECONDS`` on its (measured) link goes plain, with sendfile."""
    monkeypatch.setattr(wire.CPU, "idle", lambda: 0.0)
    data = weights(6_000_000, seed=14)
    url = client(three[0]).url
    wire.METER.transfer(url, "up", 64 << 20, 64 << 20, 0.5)  # 128 MiB/s: 6 MB in 0.05 s
    upload(tmp_path, three[0], data)
    wire.METER.rates[(url, "up")] = 1e6  # 1 MB/s: 6 s
    upload(tmp_path, three[0], data + b"x")
    assert [codec for codec, _ in sent] == [None, "planes"]


@pytest.mark.parametrize("n", [0, 1, 4095, 128 * 1024 + 1, wire.BLOCK])
def test_a_raw_frame_holds_the_bytes_as_they_are(n):
    data = weights(n + 1)[:n]
    frame = wire.raw_frame(data)
    assert planes.decode(frame) == data
    table, _ = planes.read_table(io.BytesIO(frame).read)
    assert {coding for coding, _, _ in table.sections} <= {planes.RAW} and len(frame) <= n + 32  # nothing compressed
    # between compressed frames, as an upload mixes them
    z = planes.encode(b"x" * 5000)
    stream = decoding.PlanesDecompressing(io.BytesIO(z + frame + z), 10_000 + n)
    assert stream.read() == b"x" * 5000 + data + b"x" * 5000
    stream.finish()


@pytest.mark.parametrize("n", [0, 1, wire.RAW_BLOCK, wire.RAW_BLOCK + 1, wire.BLOCK, 3 * wire.RAW_BLOCK - 7])
def test_a_raw_zstd_frame_is_a_zstd_frame_of_the_bytes_as_they_are(n):
    """For a worker of the previous release: any zstd decoder reads it."""
    data = os.urandom(n)
    frame = wire.raw_frame(data, "zstd")
    assert zstandard.ZstdDecompressor().decompress(frame) == data
    assert len(frame) == 9 + n + 3 * max(1, -(-n // wire.RAW_BLOCK))  # headers only: nothing compressed
    z = zstandard.ZstdCompressor(level=1).compress(b"x" * 5000)
    stream = decoding.ZstdDecompressing(io.BytesIO(z + frame + z), 10_000 + n)
    assert stream.read() == b"x" * 5000 + data + b"x" * 5000
    stream.finish()


def test_an_upload_started_while_the_cores_are_busy_compresses_once_they_free(three, tmp_path, remote, sent,
                                                                            monkeypatch):
    """Uploads sent while detection hashes start on busy cores: their first blocks go as raw
    frames, the ones read after the hashing compressed; what the meter learns of the ratio is
    from the compressed blocks alone."""
    answers = iter([0.0, 0.0])  # busy at the start and for the first block; idle afterwards
    monkeypatch.setattr(wire.CPU, "idle", lambda: next(answers, 1.0))
    data = weights(3 * wire.BLOCK, seed=12)
    name, answer = upload(tmp_path, three[2], data)
    assert answer["created"] and three[2].shard(name).read_bytes() == data
    ((codec, on_wire),) = sent
    block_wire = len(wire.raw_frame(data[:wire.BLOCK]))
    assert codec and block_wire + 0.7 * 2 * wire.BLOCK < on_wire < block_wire + 0.85 * 2 * wire.BLOCK
    assert 0.7 < wire.METER.ratio < 0.85


def test_a_block_that_does_not_shrink_ends_the_compressing_of_its_transfer(tmp_path, monkeypatch):
    monkeypatch.setattr(wire.CPU, "idle", lambda: 1.0)
    data = weights(wire.BLOCK, seed=13) + os.urandom(3 * wire.BLOCK)
    src = tmp_path / "src"
    src.write_bytes(data)
    compressed: list[int] = []
    real = wire.compress_block
    monkeypatch.setattr(wire, "compress_block", lambda block, *a: compressed.append(len(block)) or real(block, *a))
    frames = wire.Frames(b"", str(src), 0, len(data), per_block=True)
    out = b"".join(frames)
    stream = decoding.PlanesDecompressing(io.BytesIO(out), len(data))
    assert stream.read() == data
    assert compressed == [wire.BLOCK, wire.BLOCK]  # the weights, then one random block: no more tries
    assert frames.packed[0] == 2 * wire.BLOCK


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("localhost", True),
    ("10.0.0.2", False), ("192.168.1.7", False), ("fe80::1", False), ("worker-3.lan", False), (None, False),
])
def test_loopback_is_told_from_a_host_on_the_lan(host, loopback):
    assert is_loopback(host) is loopback
