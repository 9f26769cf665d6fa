"""Server-rendered pages, forms with login and CSRF, the chart and the live stream."""
from __future__ import annotations

import json
import socket
import threading

import pytest

from pipeline.db.engine import session_scope
from pipeline.db.transitions import create_job, transition
from tests.checkpoints import atomic_save, state_dict
from tests.processes import wait_for
from tests.webui.conftest import csrf_of, one_job, seed
from tests.webui.test_api import dead_letter

PAGES = ["/", "/checkpoints", "/health", "/jobs", "/workers", "/dead-letters", "/login"]


@pytest.mark.parametrize("url", PAGES)
def test_every_page_renders_empty(client, url):
    r = client.get(url)
    assert r.status_code == 200 and b"ckpt-pipeline" in r.data


def test_pages_show_the_seeded_checkpoint(client, web_settings):
    ids = seed(web_settings)
    assert b"step_1.safetensors" in client.get("/checkpoints").data
    assert b"2/2 verified" in client.get("/checkpoints").data
    detail = client.get(f"/checkpoints/{ids['checkpoint']}").get_data(as_text=True)
    assert "shard" in detail and "w-0" in detail and "healthy" in detail
    assert client.get("/checkpoints?state=detected").get_data(as_text=True).count("step_1") == 0
    matrix = client.get("/health").get_data(as_text=True)
    assert 'class="cell verified"' in matrix
    job = client.get(f"/jobs/{ids['store_job']}").get_data(as_text=True)
    assert "replicated" in job and "seeded verified" in job
    assert b"w-1" in client.get("/workers").data


def test_unknown_pages_are_404_pages(client):
    r = client.get("/checkpoints/777")
    assert r.status_code == 404 and b"no checkpoint" in r.data


def test_overview_chart_is_drawn_from_real_transfers(client, web_settings):
    assert b"No store or restore has finished yet" in client.get("/").data
    seed(web_settings)
    html = client.get("/").get_data(as_text=True)
    assert html.count('class="bar-store"') == 1 and html.count('class="bar-restore"') == 1
    assert "store job 1:" in html and "written to verified in" in html


def test_actions_need_login(client):
    r = client.get("/actions")
    assert r.status_code == 302 and "/login" in r.headers["Location"]
    r = client.post("/actions/store", data={"path": "/x"})
    assert r.status_code == 401


def test_wrong_token_does_not_log_in(client):
    page = client.get("/login").get_data(as_text=True)
    r = client.post("/login", data={"token": "nope", "csrf_token": csrf_of(page)})
    assert r.status_code == 403
    assert client.get("/actions").status_code == 302


def test_forms_need_the_csrf_token(admin, tmp_path):
    path = atomic_save(state_dict(2), tmp_path / "runs" / "r1" / "step_2.safetensors")
    r = admin.post("/actions/store", data={"path": str(path)})
    assert r.status_code == 403 and b"CSRF" in r.data
    r = admin.post("/actions/store", data={"path": str(path), "csrf_token": "forged"})
    assert r.status_code == 403


def test_store_form_creates_a_job_and_goes_to_its_page(admin, web_settings, tmp_path):
    path = atomic_save(state_dict(2), tmp_path / "runs" / "r1" / "step_2.safetensors")
    token = csrf_of(admin.get("/actions").get_data(as_text=True))
    r = admin.post("/actions/store", data={"path": str(path), "csrf_token": token})
    job = one_job(web_settings, "store")
    assert r.status_code == 303 and r.headers["Location"] == f"/jobs/{job.id}"
    r = admin.post("/actions/store", data={"path": "/etc/hosts", "csrf_token": token})
    assert r.status_code == 400 and b"not a checkpoint inside a watched root" in r.data
    assert b'id="store-error"' in r.data and b'value="/etc/hosts"' in r.data  # in the form, input kept


def test_restore_and_scrub_forms(admin, web_settings, tmp_path):
    ids = seed(web_settings)
    token = csrf_of(admin.get("/actions").get_data(as_text=True))
    out = tmp_path / "runs" / "out"
    r = admin.post("/actions/restore", data={"checkpoint": ids["checkpoint"], "dest": str(out), "csrf_token": token})
    assert r.status_code == 303 and one_job(web_settings, "restore").params["dest"] == str(out)
    r = admin.post("/actions/scrub", data={"csrf_token": token})
    assert r.status_code == 303 and r.headers["Location"] == "/jobs?kind=scrub"


def test_pin_unpin_and_forget_from_the_checkpoint_page(admin, web_settings):
    """The retention buttons act, and a refusal is shown on the page that asked, in its words."""
    older = seed(web_settings, step=1)["checkpoint"]
    page = admin.get(f"/checkpoints/{older}").get_data(as_text=True)
    assert 'id="pin-form"' in page and 'id="forget-form"' in page
    token = csrf_of(page)
    r = admin.post(f"/checkpoints/{older}/pin", data={"note": "paper run", "csrf_token": token})
    assert r.status_code == 303 and r.headers["Location"] == f"/checkpoints/{older}"
    page = admin.get(f"/checkpoints/{older}").get_data(as_text=True)
    assert "pinned: paper run" in page and 'id="unpin-form"' in page and 'id="forget-form"' not in page
    page = admin.post(f"/checkpoints/{older}/forget", data={"csrf_token": token},
                      follow_redirects=True).get_data(as_text=True)
    assert "is pinned; `ckpt unpin" in page
    admin.post(f"/checkpoints/{older}/unpin", data={"csrf_token": token})
    page = admin.post(f"/checkpoints/{older}/forget", data={"csrf_token": token},
                      follow_redirects=True).get_data(as_text=True)
    assert "is the newest protected checkpoint" in page  # what a resume restores is always kept
    seed(web_settings, step=2)
    page = admin.post(f"/checkpoints/{older}/forget", data={"csrf_token": token},
                      follow_redirects=True).get_data(as_text=True)
    assert "forgotten: it can no longer be restored" in page and 'id="forget-form"' not in page
    assert 'class="state forgotten"' in page
    assert admin.post(f"/checkpoints/{older}/pin", data={"csrf_token": "forged"}).status_code == 403
    assert admin.post("/checkpoints/9999/pin", data={"csrf_token": token}).status_code == 404


def test_requeue_form(admin):
    letter = dead_letter()
    page = admin.get("/dead-letters").get_data(as_text=True)
    assert letter[:12] in page
    r = admin.post("/dead-letters/requeue", data={"id": letter, "csrf_token": csrf_of(page)})
    assert r.status_code == 303
    assert b"No dead letter" in admin.get("/dead-letters").data


def test_job_stream_sends_events_until_the_job_ends(client, web_settings):
    with session_scope(web_settings.db_url) as s:
        job_id = create_job(s, "restore", checkpoint_id=None, params={"dest": "/x"}).id
    r = client.get(f"/jobs/{job_id}/stream", buffered=False)
    assert r.mimetype == "text/event-stream"
    chunks = iter(r.response)
    first = json.loads(next(chunks).decode().removeprefix("data: "))
    assert first["state"] == "queued" and not first["terminal"]
    with session_scope(web_settings.db_url) as s:
        transition(s, job_id, "restore", "queued", "failed", detail="test")
    events = [json.loads(c.decode().removeprefix("data: ")) for c in chunks if c.startswith(b"data: ")]
    assert events[-1]["state"] == "failed" and events[-1]["terminal"]
    r.close()


def test_a_store_stream_ends_once_the_job_rests_at_verified(client, web_settings):
    """A verified store waits for rotation, perhaps for hours: its stream ends there."""
    ids = seed(web_settings)
    r = client.get(f"/jobs/{ids['store_job']}/stream", buffered=False)
    events = [json.loads(c.decode().removeprefix("data: ")) for c in r.response if c.startswith(b"data: ")]
    assert [e["state"] for e in events] == ["verified"] and events[0]["terminal"]
    r.close()


def test_event_streams_are_capped_per_client_and_in_all(app, web_settings):
    """Open streams never take every thread: the third from one client, or one past the total,
    is a 429; closing one frees its slot."""
    from webui import streams

    app.config.update(CKPT_STREAMS=3, CKPT_STREAMS_PER_CLIENT=2)
    with session_scope(web_settings.db_url) as s:
        job_id = create_job(s, "restore", checkpoint_id=None, params={"dest": "/x"}).id

    def open_from(addr: str):
        c = app.test_client()
        r = c.get(f"/jobs/{job_id}/stream", buffered=False, environ_base={"REMOTE_ADDR": addr})
        if r.status_code == 200:
            next(iter(r.response))  # the stream is running
        return r

    a1, a2 = open_from("10.0.0.1"), open_from("10.0.0.1")
    third = open_from("10.0.0.1")
    assert (a1.status_code, a2.status_code, third.status_code) == (200, 200, 429)
    assert third.headers["Retry-After"] == "10"
    b1 = open_from("10.0.0.2")
    assert b1.status_code == 200 and open_from("10.0.0.3").status_code == 429  # 3 in all
    a1.close()
    assert streams.open_count() == 2
    c1 = open_from("10.0.0.3")
    assert c1.status_code == 200
    for r in (a2, b1, c1):
        r.close()
    assert streams.open_count() == 0


def test_a_stream_whose_page_has_gone_ends_and_frees_its_slot(app, web_settings, monkeypatch):
    """A job page reloads on every event and drops its stream; the server learns that only by
    writing. A quiet stream writes a comment now and then, so it ends soon after its page has
    gone, and the reloaded page gets the slot (two per client) instead of a 429."""
    from werkzeug.serving import make_server

    from webui import pages, streams

    monkeypatch.setattr(pages, "HEARTBEAT_SECONDS", 0.2)
    with session_scope(web_settings.db_url) as s:
        job_id = create_job(s, "restore", checkpoint_id=None, params={"dest": "/x"}).id  # never changes
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as sock:
            sock.sendall(f"GET /jobs/{job_id}/stream HTTP/1.1\r\nHost: test\r\n\r\n".encode())
            got = b""
            while b": still here" not in got:  # the event, then the heartbeat of a quiet stream
                got += sock.recv(4096)
            assert b'"state": "queued"' in got and streams.open_count() == 1
        wait_for(lambda: streams.open_count() == 0, 10, "the stream of a page that has gone to end")
    finally:
        server.shutdown()
        thread.join(10)


def test_logout_needs_csrf(admin):
    assert admin.post("/logout").status_code == 403
