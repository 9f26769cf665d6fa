"""The JSON API with Flask's test client: every endpoint, each 4xx, auth."""
from __future__ import annotations

import dramatiq
import pytest

from tests.webui.conftest import consumer, one_job, seed


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def dead_letter(actor: str = "shard", args: tuple = (424242,)) -> str:
    """Dead-letter a real message the way Dramatiq does: consume it and nack it."""
    broker = dramatiq.get_broker()
    sent = broker.get_actor(actor).send(*args)
    consumer = broker.consume("ckpt", prefetch=1, timeout=500)
    try:
        for message in consumer:
            if message is not None and message.message_id == sent.message_id:
                consumer.nack(message)
                return message.options["redis_message_id"]
    finally:
        consumer.close()
    raise AssertionError("message not delivered")


def test_read_endpoints_return_the_control_plane(client, web_settings):
    ids = seed(web_settings)
    cks = client.get("/api/checkpoints").get_json()["checkpoints"]
    assert [(c["id"], c["state"], c["replicas_verified"], c["health"]) for c in cks] == [
        (ids["checkpoint"], "verified", 2, "healthy")]
    detail = client.get(f"/api/checkpoints/{ids['checkpoint']}").get_json()
    assert detail["files"][0]["shards"][0]["replicas"][0]["health"] == "verified"
    assert client.get("/api/checkpoints?state=detected").get_json()["checkpoints"] == []
    jobs = client.get("/api/jobs?kind=restore").get_json()["jobs"]
    assert [j["id"] for j in jobs] == [ids["restore_job"]]
    assert client.get("/api/jobs?state=verified").get_json()["jobs"][0]["id"] == ids["store_job"]
    job = client.get(f"/api/jobs/{ids['store_job']}").get_json()
    assert [e["to"] for e in job["timeline"]] == ["detected", "sharded", "replicated", "verified"]
    assert {w["id"] for w in client.get("/api/workers").get_json()["workers"]} == {"w-0", "w-1"}
    health = client.get("/api/health").get_json()
    assert health["shards"] == {"healthy": len(detail["files"][0]["shards"])}
    assert client.get("/api/dead-letters").get_json() == {"dead_letters": [], "more": False}


@pytest.mark.parametrize("url", ["/api/checkpoints/9999", "/api/jobs/9999"])
def test_unknown_ids_are_404_with_a_reason(client, url):
    r = client.get(url)
    assert r.status_code == 404 and r.is_json and "9999" in r.get_json()["error"]


def test_unknown_job_kind_is_400(client):
    r = client.get("/api/jobs?kind=bogus")
    assert r.status_code == 400 and "unknown job kind" in r.get_json()["error"]


@pytest.mark.parametrize("method,url,body", [
    ("post", "/api/store", {"path": "/x"}),
    ("post", "/api/restore", {"checkpoint": "1", "dest": "/tmp/y"}),
    ("post", "/api/scrub", {}),
    ("post", "/api/dead-letters/all/requeue", None),
    ("post", "/api/gc", {"dry_run": True}),
    ("post", "/api/checkpoints/1/pin", {}),
    ("post", "/api/checkpoints/1/forget", {"dry_run": True}),
])
def test_mutations_need_the_admin_token(client, method, url, body):
    r = getattr(client, method)(url, json=body)
    assert r.status_code == 401 and "Authorization: Bearer" in r.get_json()["error"]
    r = getattr(client, method)(url, json=body, headers=bearer("wrong"))
    assert r.status_code == 403 and "wrong" in r.get_json()["error"]


def test_get_never_mutates(client, web_settings):
    for url in ("/api/store", "/api/restore", "/api/scrub"):
        assert client.get(url).status_code == 405
    assert one_job(web_settings, "store") is None


def test_store_accepts_a_checkpoint_inside_a_root(client, web_settings, token, tmp_path):
    from tests.checkpoints import atomic_save, state_dict

    path = atomic_save(state_dict(3), tmp_path / "runs" / "r1" / "step_3.safetensors")
    r = client.post("/api/store", json={"path": str(path)}, headers=bearer(token))
    assert r.status_code == 202, r.get_json()
    doc = r.get_json()
    assert doc["state"] == "detected" and doc["created"] is True
    assert r.headers["Location"] == f"/api/jobs/{doc['id']}"
    from pipeline.queues import host_queue

    # the shard message, on the real broker, on the queue of the host that holds the files
    redis = dramatiq.get_broker().client
    assert redis.llen(f"dramatiq:{host_queue(web_settings.host_id)}") == 1 and redis.llen("dramatiq:ckpt") == 0


@pytest.mark.parametrize("body,status,needle", [
    (None, 400, "JSON object"),
    ({}, 400, "path"),
    ({"path": ""}, 400, "path"),
    ({"path": "/etc/passwd"}, 400, "not a checkpoint inside a watched root"),
])
def test_store_refuses_bad_bodies_and_paths(client, token, body, status, needle):
    kwargs = {"json": body} if body is not None else {"data": "not json", "content_type": "text/plain"}
    r = client.post("/api/store", headers=bearer(token), **kwargs)
    assert r.status_code == status and needle in r.get_json()["error"]


def test_store_of_an_incomplete_checkpoint_is_400(client, token, tmp_path):
    (tmp_path / "runs" / "r1" / "step_9").mkdir()
    r = client.post("/api/store", json={"path": str(tmp_path / "runs" / "r1" / "step_9")}, headers=bearer(token))
    assert r.status_code == 400 and "not complete" in r.get_json()["error"]


def test_restore_validates_checkpoint_and_destination(client, web_settings, token, tmp_path):
    ids = seed(web_settings)
    r = client.post("/api/restore", json={"checkpoint": "424242", "dest": str(tmp_path / "d")}, headers=bearer(token))
    assert r.status_code == 404
    existing = tmp_path / "runs" / "r1" / "exists"
    existing.write_text("keep")
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": str(existing)},
                    headers=bearer(token))
    assert r.status_code == 409 and "already exists" in r.get_json()["error"]
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"]}, headers=bearer(token))
    assert r.status_code == 400 and "dest" in r.get_json()["error"]
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": str(tmp_path / "runs" / "new")},
                    headers=bearer(token))
    assert r.status_code == 202 and r.get_json()["kind"] == "restore"
    assert existing.read_text() == "keep"


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, []])
def test_restore_flags_must_be_json_booleans(client, web_settings, token, tmp_path, value):
    """``"overwrite": "false"`` was read as true; a flag that is not a JSON boolean is a 400."""
    ids = seed(web_settings)
    existing = tmp_path / "exists"
    existing.write_text("keep")
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": str(existing), "overwrite": value},
                    headers=bearer(token))
    assert r.status_code == 400 and '"overwrite" must be true or false' in r.get_json()["error"]
    assert existing.read_text() == "keep"
    r = client.post("/api/gc", json={"dry_run": value}, headers=bearer(token))
    assert r.status_code == 400 and '"dry_run" must be true or false' in r.get_json()["error"]


def test_restore_destinations_outside_the_restore_roots_are_refused(client, web_settings, token, tmp_path_factory):
    """Over HTTP only the restore roots count (the server's current directory is not the caller's)."""
    ids = seed(web_settings)
    outside = tmp_path_factory.mktemp("outside")
    for dest in (outside / "x", web_settings.home / "evil", "/etc/ckpt-restore-test"):
        r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": str(dest), "overwrite": True},
                        headers=bearer(token))
        assert r.status_code == 400, (dest, r.get_json())
        assert "restore roots" in r.get_json()["error"] or "home" in r.get_json()["error"]


def test_restore_of_a_checkpoint_that_is_not_protected_is_400(client, web_settings, token, tmp_path):
    from pipeline import operations
    from tests.checkpoints import atomic_save, state_dict

    path = atomic_save(state_dict(5), tmp_path / "runs" / "r1" / "step_5.safetensors")
    operations.store(web_settings, str(path))
    r = client.post("/api/restore", json={"checkpoint": str(path), "dest": str(tmp_path / "runs" / "o")},
                    headers=bearer(token))
    assert r.status_code == 400 and "only replicated or verified" in r.get_json()["error"]


def test_scrub_starts_one_job_per_live_worker(client, web_settings, token):
    seed(web_settings)
    r = client.post("/api/scrub", json={}, headers=bearer(token))
    assert r.status_code == 202
    assert sorted(j["params"]["worker_id"] for j in r.get_json()["jobs"]) == ["w-0", "w-1"]
    r = client.post("/api/scrub", json={"workers": "w-0"}, headers=bearer(token))
    assert r.status_code == 400
    r = client.post("/api/scrub", json={"workers": ["nope"]}, headers=bearer(token))
    assert r.status_code == 400 and "unknown storage worker" in r.get_json()["error"]


def test_scrub_without_workers_is_409(client, token):
    r = client.post("/api/scrub", json={}, headers=bearer(token))
    assert r.status_code == 409


def test_dead_letters_are_listed_and_requeued(client, token):
    letter = dead_letter()
    listed = client.get("/api/dead-letters").get_json()["dead_letters"]
    assert [(d["id"], d["actor"], d["args"]) for d in listed] == [(letter, "shard", [424242])]
    assert client.post("/api/dead-letters/nope/requeue", headers=bearer(token)).status_code == 404
    r = client.post(f"/api/dead-letters/{letter}/requeue", headers=bearer(token))
    assert r.status_code == 200 and r.get_json() == {"requeued": 1}
    assert client.get("/api/dead-letters").get_json()["dead_letters"] == []
    assert dramatiq.get_broker().client.llen("dramatiq:ckpt") == 1  # a fresh message is queued


def test_metrics_are_prometheus_text_from_real_rows(client, web_settings):
    seed(web_settings)
    text = client.get("/metrics").get_data(as_text=True)
    assert 'ckpt_jobs{kind="store",state="verified"} 1.0' in text
    assert 'ckpt_jobs{kind="restore",state="done"} 1.0' in text
    assert 'ckpt_shards{health="healthy"}' in text and 'ckpt_shards{health="lost"} 0.0' in text
    assert 'ckpt_worker_up{state="up",worker="w-0"} 1.0' in text
    assert "ckpt_transfer_seconds_bucket" in text and "ckpt_bytes_stored" in text


def test_metrics_show_each_queues_depth_and_whether_a_live_consumer_serves_it(client, web_settings):
    from pipeline import consumers
    from pipeline.db.engine import session_scope
    from pipeline.db.transitions import create_job
    from pipeline.steps import Send
    from pipeline.tasks.sending import send_all

    with session_scope(web_settings.db_url) as s:
        job_id = create_job(s, "scrub", checkpoint_id=None, params={"worker_id": "w-0"}).id
        consumers.beat(s, "h1", ["ckpt.host.h1"])
    send_all([Send("scrub", (job_id,))])
    send_all([Send("scrub", (job_id,))])  # a re-drive while it is queued adds nothing
    text = client.get("/metrics").get_data(as_text=True)
    assert 'ckpt_queue_depth{queue="ckpt"} 1.0' in text
    assert 'ckpt_queue_consumer_up{host="h1",queue="ckpt.host.h1"} 1.0' in text


@pytest.mark.parametrize("endpoint", ["/api/store", "/api/restore", "/api/scrub"])
def test_hostile_json_is_a_400_not_a_crash(client, token, endpoint):
    nested = "[" * 100_000 + "]" * 100_000
    for data in (nested, '{"path": ' + nested + "}", "\xff\xfe", "{" * 10):
        r = client.post(endpoint, data=data, content_type="application/json", headers=bearer(token))
        assert r.status_code == 400, (endpoint, data[:20], r.status_code)


def test_lists_are_paginated_newest_first(client, web_settings):
    seed(web_settings)
    first = client.get("/api/jobs?limit=1").get_json()
    assert len(first["jobs"]) == 1 and first["next_before"] == first["jobs"][0]["id"]
    rest = client.get(f"/api/jobs?limit=1&before={first['next_before']}").get_json()
    assert rest["jobs"][0]["id"] < first["jobs"][0]["id"]
    assert client.get("/api/checkpoints?limit=0").status_code == 400


def test_pin_forget_and_gc_over_http(client, web_settings, token):
    ids = seed(web_settings)
    cid = ids["checkpoint"]
    pinned = client.post(f"/api/checkpoints/{cid}/pin", json={"note": "paper run"}, headers=bearer(token))
    assert pinned.status_code == 200 and pinned.get_json()["pinned"] and pinned.get_json()["pin_note"] == "paper run"
    r = client.post(f"/api/checkpoints/{cid}/forget", json={"dry_run": True}, headers=bearer(token))
    assert r.status_code == 400 and "pinned" in r.get_json()["error"]
    assert client.post(f"/api/checkpoints/{cid}/unpin", headers=bearer(token)).get_json()["pinned"] is False
    r = client.post(f"/api/checkpoints/{cid}/forget", json={"dry_run": True}, headers=bearer(token))
    assert r.status_code == 400 and "newest protected checkpoint" in r.get_json()["error"]
    assert client.post("/api/checkpoints/9999/pin", headers=bearer(token)).status_code == 404
    dry = client.post("/api/gc", json={"dry_run": True}, headers=bearer(token))
    assert dry.status_code == 200 and dry.get_json()["freed"] == [] and dry.get_json()["jobs"] == []
    cap = client.get("/api/capacity").get_json()
    assert cap["capacity"]["workers"] == 2 and cap["capacity"]["stored"] > 0
    assert cap["runs"][str(web_settings.roots[0].rstrip("*")) + "r1"]["unique"] == cap["capacity"]["stored"]


def test_reads_never_take_the_write_lock(client, web_settings):
    """A writer holds SQLite's write lock (as the pipeline does, briefly, all day): every page,
    the API and /metrics still answer, from a snapshot, instead of queueing behind it."""
    import sqlite3

    seed(web_settings)
    writer = sqlite3.connect(web_settings.db_url.removeprefix("sqlite:///"), isolation_level=None, timeout=1)
    writer.execute("BEGIN IMMEDIATE")
    try:
        writer.execute("UPDATE storage_workers SET last_error = 'held by a writer'")
        for url in ("/", "/checkpoints", "/jobs", "/health", "/workers", "/metrics", "/api/checkpoints",
                    "/api/capacity"):
            r = client.get(url)
            assert r.status_code == 200, (url, r.status_code, r.get_data(as_text=True)[:300])
            assert b"held by a writer" not in r.get_data()  # the snapshot, not the uncommitted write
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_a_restore_to_a_host_without_a_running_consumer_is_refused_at_once(client, web_settings, token, tmp_path):
    """The web host of a multi-host deployment runs no Dramatiq: a restore routed to its queue
    waited for ever. A host whose consumer is gone (or never was) is refused with the reason."""
    ids = seed(web_settings)
    consumer(web_settings, "h-stale", seconds_ago=120)
    jobs_before = one_job(web_settings, "restore").id
    for host in ("h-ghost", "h-stale"):
        r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": str(tmp_path / "runs" / "n"),
                                              "host": host}, headers=bearer(token))
        assert r.status_code == 409, r.get_json()
        error = r.get_json()["error"]
        assert f"no Dramatiq worker consumes host {host}'s queue" in error and web_settings.host_id in error
    assert one_job(web_settings, "restore").id == jobs_before  # nothing recorded
    listed = {h["id"]: h for h in client.get("/api/hosts").get_json()["hosts"]}
    assert listed[web_settings.host_id]["consumer_live"] and not listed["h-stale"]["consumer_live"]
    assert listed["h-stale"]["label"] == "h-stale.example"


def test_a_restore_goes_to_the_queue_of_the_host_picked(client, web_settings, token, tmp_path):
    from pipeline.queues import host_queue

    ids = seed(web_settings)
    consumer(web_settings, "h2")
    dest = "/data/on-h2/restored"  # a path on h2's disk: checked there, not on the web host
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": dest, "host": "h2"},
                    headers=bearer(token))
    assert r.status_code == 202, r.get_json()
    assert r.get_json()["host"] == "h2"
    job = one_job(web_settings, "restore")
    assert job.params["host"] == "h2" and job.params["dest"] == dest and "extra_roots" not in job.params
    redis = dramatiq.get_broker().client
    assert redis.llen(f"dramatiq:{host_queue('h2')}") == 1
    assert redis.llen(f"dramatiq:{host_queue(web_settings.host_id)}") == 0 and redis.llen("dramatiq:ckpt") == 0
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": "relative/x", "host": "h2"},
                    headers=bearer(token))
    assert r.status_code == 400 and "not an absolute path" in r.get_json()["error"]
    r = client.post("/api/restore", json={"checkpoint": ids["checkpoint"], "dest": dest, "host": 7},
                    headers=bearer(token))
    assert r.status_code == 400 and '"host"' in r.get_json()["error"]
