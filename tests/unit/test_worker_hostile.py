"""Hostile clients of a real storage worker process: each gets the right 4xx, nothing is
written, memory stays bounded and the worker keeps serving."""
from __future__ import annotations

import hashlib
import http.client
import os
import pickle
import socket
import threading
import time

import pytest

from pipeline.cluster import auth
from pipeline.cluster.client import WorkerClient
from tests.processes import KEY, StorageWorker, base_env

LIMIT = 1024 * 1024


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    w = StorageWorker(tmp / "data", base_env(tmp / "home", CKPT_WORKER_MAX_UPLOAD=str(LIMIT)),
                      tmp / "worker.log").start()
    yield w
    w.stop()


def stored(worker) -> list[str]:
    return sorted(p.name for p in (worker.data / "shards").rglob("*") if p.is_file())


def raw(worker, method: str, path: str, body: bytes = b"", headers: dict | None = None,
        sign_body: bool = False) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=10)
    h = auth.sign(KEY.encode(), method, path, body if sign_body else None, node=worker.node_id)
    h.update(headers or {})
    conn.request(method, path, body=body, headers=h)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def read_answer(s: socket.socket) -> str:
    """One whole HTTP answer from a raw socket (headers and Content-Length bytes)."""
    s.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := s.recv(65536)):
        body += chunk
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def still_serving(worker) -> None:
    assert WorkerClient(worker.url, KEY.encode(), worker.node_id).status()["node_id"]


def rss_kib(worker) -> int:
    total = 0
    for pid in worker.pids():
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return total


def test_upload_longer_than_declared_is_refused(worker):
    data, extra = os.urandom(64 * 1024), os.urandom(1000)
    name = hashlib.sha256(data + extra).hexdigest()
    before = stored(worker)
    # Content-Length says 64 KiB; 1000 more bytes follow. Only the declared bytes are read:
    # they do not hash to the name, and the rest is never taken as part of the shard.
    s = socket.create_connection(("127.0.0.1", worker.port))
    hdrs = auth.sign(KEY.encode(), "PUT", f"/v1/shards/{name}", node=worker.node_id)
    head = "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    s.sendall(f"PUT /v1/shards/{name} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{head}\r\n".encode()
              + data + extra)
    answer = read_answer(s)
    s.close()
    assert answer.startswith("HTTP/1.1 422"), answer[:200]
    assert stored(worker) == before
    still_serving(worker)


def test_upload_over_the_limit_is_413_before_any_byte_is_read(worker):
    name = "ab" * 32
    s = socket.create_connection(("127.0.0.1", worker.port))
    hdrs = auth.sign(KEY.encode(), "PUT", f"/v1/shards/{name}", node=worker.node_id)
    head = "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    s.sendall(f"PUT /v1/shards/{name} HTTP/1.1\r\nHost: x\r\nContent-Length: {100 * LIMIT}\r\n{head}\r\n".encode())
    answer = read_answer(s)  # answered without the body being sent
    s.close()
    assert answer.startswith("HTTP/1.1 413") and "CKPT_WORKER_MAX_UPLOAD" in answer, answer[:300]
    assert not list((worker.data / "tmp").iterdir())
    still_serving(worker)


def test_a_pickle_is_never_unpickled(worker):
    class Boom:
        def __reduce__(self):  # would run on unpickling
            return (os.system, ("touch /tmp/ckpt-pwned",))

    payload = pickle.dumps(Boom())
    for path in ("/v1/verify", "/v1/stat", "/v1/quarantine"):
        status, body = raw(worker, "POST", path, payload, {"Content-Type": "application/octet-stream"},
                           sign_body=True)
        assert status == 400, (path, body)
    name = hashlib.sha256(b"x").hexdigest()
    status, _ = raw(worker, "PUT", f"/v1/shards/{name}", payload)  # not the bytes of its name
    assert status == 422
    assert not os.path.exists("/tmp/ckpt-pwned")
    still_serving(worker)


def test_an_oversized_header_is_refused(worker):
    status, _ = raw(worker, "GET", "/v1/status", headers={"X-Junk": "a" * 100_000})
    assert 400 <= status < 500
    still_serving(worker)


def test_an_existing_shard_is_never_overwritten_with_other_bytes(worker, tmp_path):
    client = WorkerClient(worker.url, KEY.encode(), worker.node_id)
    good = os.urandom(10_000)
    name = hashlib.sha256(good).hexdigest()
    (tmp_path / "good").write_bytes(good)
    client.put_range(name, b"", str(tmp_path / "good"), 0, len(good))
    (tmp_path / "evil").write_bytes(os.urandom(10_000))
    answer = client.put_range(name, b"", str(tmp_path / "evil"), 0, 10_000)
    assert answer["already_present"] is True
    assert worker.shard(name).read_bytes() == good


def test_slow_loris_connections_do_not_stop_the_worker(worker):
    """Many connections that send their headers one byte at a time: the worker still
    answers others promptly, and its memory stays bounded."""
    before = rss_kib(worker)
    stop = threading.Event()
    socks = []
    for _ in range(64):
        s = socket.create_connection(("127.0.0.1", worker.port))
        s.sendall(b"PUT /v1/shards/" + b"ab" * 32 + b" HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)

    def drip() -> None:
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            time.sleep(0.5)

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        worst = 0.0
        for _ in range(6):
            started = time.monotonic()
            still_serving(worker)
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.5)
        assert worst < 2.0, f"a status request took {worst:.1f} s under slow-loris"
        assert rss_kib(worker) - before < 64 * 1024
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
    still_serving(worker)
