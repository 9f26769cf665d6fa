"""The storage worker daemon, as a real process on loopback."""
from __future__ import annotations

import hashlib
import http.client
import json
import os

import pytest

from pipeline.cluster import auth
from pipeline.cluster.client import WorkerClient
from pipeline.errors import UntrustedAnswer, WorkerError
from tests.processes import KEY, StorageWorker, base_env


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sw")
    w = StorageWorker(tmp / "data", base_env(tmp / "home"), tmp / "worker.log").start()
    yield w
    w.stop()


@pytest.fixture
def client(worker):
    return WorkerClient(worker.url, KEY.encode(), worker.node_id)


def put_bytes(client, tmp_path, data: bytes, header: bytes = b"", name: str | None = None):
    src = tmp_path / "src"
    src.write_bytes(data)
    name = name or hashlib.sha256(header + data).hexdigest()
    return name, client.put_range(name, header, str(src), 0, len(data))


def test_upload_is_stored_under_its_hash_and_served_back(client, tmp_path, worker):
    data = os.urandom(3_000_000)
    name, answer = put_bytes(client, tmp_path, data, header=b"HDR")
    assert answer["created"] is True
    assert (worker.data / "shards" / name[:2] / name[2:4] / name).stat().st_size == len(data) + 3
    conn, resp = client.open_shard(name)
    assert resp.read() == b"HDR" + data
    conn.close()


def test_second_upload_answers_already_present(client, tmp_path):
    data = os.urandom(1000)
    put_bytes(client, tmp_path, data)
    _, answer = put_bytes(client, tmp_path, data)
    assert answer == {"name": hashlib.sha256(data).hexdigest(), "size": 1000, "created": False,
                      "already_present": True, "chain": []}


def test_body_that_does_not_match_its_name_is_refused_and_never_visible(client, tmp_path, worker):
    wrong = "ab" * 32
    with pytest.raises(WorkerError, match="422.*not to its name") as info:
        put_bytes(client, tmp_path, b"some bytes", name=wrong)
    assert info.value.status == 422
    assert client.head(wrong) is None
    assert os.listdir(worker.data / "tmp") == []


def test_wrong_cluster_key_is_refused(worker, tmp_path):
    bad = WorkerClient(worker.url, b"not-the-key", worker.node_id)
    with pytest.raises(WorkerError, match="401.*wrong cluster key"):
        bad.status()
    with pytest.raises(WorkerError, match="401"):
        put_bytes(bad, tmp_path, b"x" * 100)


def test_stale_timestamp_is_refused(worker):
    path = "/v1/status"
    conn = http.client.HTTPConnection("127.0.0.1", worker.port)
    conn.request("GET", path, headers=auth.sign(KEY.encode(), "GET", path, now=1_000_000, node=worker.node_id))
    resp = conn.getresponse()
    assert resp.status == 401 and b"off this worker's clock" in resp.read()


@pytest.mark.parametrize("name", ["abc", "A" * 64, "../" + "a" * 61, "g" * 64, "a" * 65])
def test_bad_shard_names_are_refused(worker, name):
    path = f"/v1/shards/{name}"
    conn = http.client.HTTPConnection("127.0.0.1", worker.port)
    conn.request("GET", path, headers=auth.sign(KEY.encode(), "GET", path, node=worker.node_id))
    resp = conn.getresponse()
    assert resp.status in (400, 404)
    assert b"64 lowercase hex" in resp.read() or resp.status == 404


def test_verify_rehashes_from_disk_and_reports_corruption(client, tmp_path, worker):
    name, _ = put_bytes(client, tmp_path, os.urandom(10_000))
    path = worker.data / "shards" / name[:2] / name[2:4] / name
    assert client.verify([name])[0]["sha256"] == name
    raw = bytearray(path.read_bytes())
    raw[5000] ^= 0x01
    path.write_bytes(raw)
    result = client.verify([name, "cd" * 32])
    assert result[0]["sha256"] != name and result[0]["size"] == 10_000
    assert result[1] == {"name": "cd" * 32, "sha256": None, "size": None}


def test_status_reports_capacity_free_space_and_inventory(client, tmp_path):
    name, _ = put_bytes(client, tmp_path, os.urandom(500))
    st = client.status()
    assert st["api"] == 1 and st["free"] > 0 and st["capacity"] >= st["free"] and st["shards"] >= 1
    assert (name, 500) in client.inventory()
    assert client.stat([name, "ef" * 32]) == {name: 500, "ef" * 32: None}


def test_verify_refuses_malformed_bodies(worker):
    path = "/v1/verify"
    for body in (b"not json", b'{"shards": "x"}', b'{"shards": ["zz"]}'):
        conn = http.client.HTTPConnection("127.0.0.1", worker.port)
        conn.request("POST", path, body=body,
                     headers=auth.sign(KEY.encode(), "POST", path, body, node=worker.node_id))
        resp = conn.getresponse()
        assert resp.status == 400, body
        resp.read()


def test_stat_answers_held_sizes_and_refuses_bad_names(client, tmp_path, worker):
    name, _ = put_bytes(client, tmp_path, os.urandom(2_000_000))
    assert client.stat([name, "ef" * 32]) == {name: 2_000_000, "ef" * 32: None}
    with pytest.raises(WorkerError) as info:
        client.stat(["../../etc/passwd"])
    assert info.value.status == 400
    with pytest.raises(WorkerError) as info:
        WorkerClient(worker.url, b"another key", worker.node_id).stat([name])
    # refused (401), and the refusal itself is not signed with the key this client holds
    assert isinstance(info.value, UntrustedAnswer) and "answered 401" in str(info.value)


def raw_request(worker, method: str, path: str, headers: dict, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", worker.port)
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def test_a_replayed_request_is_refused_and_does_nothing(client, tmp_path, worker):
    name, _ = put_bytes(client, tmp_path, os.urandom(1000))
    path = f"/v1/shards/{name}"
    headers = auth.sign(KEY.encode(), "DELETE", path, node=worker.node_id)
    assert raw_request(worker, "DELETE", path, headers)[0] == 200
    # The shard is stored again; replaying the captured DELETE must not remove it.
    client.put_range(name, b"", str(tmp_path / "src"), 0, 1000)
    status, body = raw_request(worker, "DELETE", path, headers)
    assert status == 401 and b"replayed" in body
    assert client.head(name) == 1000


def test_a_body_other_than_the_signed_one_is_refused_and_does_nothing(client, tmp_path, worker):
    keep, _ = put_bytes(client, tmp_path, os.urandom(1000))
    path = "/v1/quarantine"
    signed = json.dumps({"shards": ["ab" * 32]}).encode()
    forged = json.dumps({"shards": [keep]}).encode()
    status, body = raw_request(worker, "POST", path,
                               auth.sign(KEY.encode(), "POST", path, signed, node=worker.node_id), forged)
    assert status == 401 and b"not the one that was signed" in body
    assert client.head(keep) == 1000


def test_requests_without_a_request_id_are_refused(worker):
    path = "/v1/status"
    headers = auth.sign(KEY.encode(), "GET", path, node=worker.node_id)
    del headers[auth.REQUEST_HEADER]
    status, body = raw_request(worker, "GET", path, headers)
    assert status == 401 and b"missing" in body


def test_hostile_json_bodies_are_400(worker):
    path = "/v1/verify"
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"shards": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        status, reply = raw_request(worker, "POST", path,
                                    auth.sign(KEY.encode(), "POST", path, body, node=worker.node_id), body)
        assert status == 400, reply[:200]
