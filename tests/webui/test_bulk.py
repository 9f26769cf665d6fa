"""Pin, unpin and forget several checkpoints at once: ``POST /api/checkpoints/bulk`` and the
lists' checkboxes with their confirmation page (webui/bulk.py). Each checkpoint is done or
refused on its own, with the reason; a dry run (the confirmation) changes nothing."""
from __future__ import annotations

from pipeline.cli.retention_cmds import LAST_COPY
from tests.webui.conftest import csrf_of
from tests.webui.test_checkpoint_list import _many


def bulk(client, token, **doc):
    return client.post("/api/checkpoints/bulk", json=doc, headers={"Authorization": f"Bearer {token}"})


def state_of(client, cid: int) -> str:
    return client.get(f"/api/checkpoints/{cid}").get_json()["state"]


def test_bulk_api_does_each_or_refuses_each_with_the_reason(client, token, web_settings):
    _many(web_settings, runs=("alpha",), per_run=10)  # ids 1..10, steps 0..900; ids 1 and 8 failed; 10 newest
    pinned = bulk(client, token, action="pin", checkpoints=[2], note="paper run").get_json()
    assert pinned["done"] == 1 and pinned["results"][0]["message"].startswith("pinned")
    assert client.get("/api/checkpoints/2").get_json()["pin_note"] == "paper run"

    seen = bulk(client, token, action="forget", checkpoints=[2, 3, 8, 10, 999], dry_run=True).get_json()
    by_id = {r["id"]: r for r in seen["results"]}
    assert seen["dry_run"] and seen["done"] == 1 and seen["refused"] == 4
    assert by_id[3]["ok"] and by_id[3]["only_local_copy"] and "ONLY copy" in by_id[3]["message"]
    assert "is pinned" in by_id[2]["message"] and "refused" in by_id[2]["message"]
    assert "only protected" in by_id[8]["message"]
    assert "newest protected checkpoint" in by_id[10]["message"]
    assert "no checkpoint 999" in by_id[999]["message"]
    assert seen["last_copy"] == LAST_COPY.format(grace=web_settings.gc_grace_seconds, keep=web_settings.keep_last)
    assert state_of(client, 3) == "verified"  # a dry run changes nothing

    done = bulk(client, token, action="forget", checkpoints=[3, 4, 10]).get_json()
    assert [r["ok"] for r in done["results"]] == [True, True, False]
    assert state_of(client, 3) == state_of(client, 4) == "forgotten" and state_of(client, 10) == "verified"
    # pinning a forgotten one is refused, the others still done
    again = bulk(client, token, action="pin", checkpoints=[3, 5]).get_json()
    assert [r["ok"] for r in again["results"]] == [False, True]
    assert "already forgotten" in again["results"][0]["message"]
    assert bulk(client, token, action="unpin", checkpoints=[2, 5]).get_json()["done"] == 2
    assert not client.get("/api/checkpoints/2").get_json()["pinned"]


def test_bulk_api_checks_its_body_and_the_token(client, token, web_settings):
    _many(web_settings, runs=("alpha",), per_run=3)
    assert client.post("/api/checkpoints/bulk", json={"action": "pin", "checkpoints": [1]}).status_code == 401
    assert bulk(client, "wrong", action="pin", checkpoints=[1]).status_code == 403
    assert bulk(client, token, action="delete", checkpoints=[1]).status_code == 400
    assert bulk(client, token, action="pin", checkpoints=[]).status_code == 400
    assert bulk(client, token, action="pin", checkpoints=["1"]).status_code == 400
    assert bulk(client, token, action="pin", checkpoints=[1], dry_run="yes").status_code == 400
    assert not client.get("/api/checkpoints/1").get_json()["pinned"]


def test_bulk_forget_from_the_list_asks_first_then_reports_each(admin, client, web_settings):
    _many(web_settings, runs=("alpha",), per_run=10)
    page = admin.get("/checkpoints").get_data(as_text=True)
    assert 'id="bulk-form"' in page and page.count('type="checkbox" name="id"') == 10
    token = csrf_of(page)
    ask = admin.post("/checkpoints/bulk", data={"action": "forget", "id": ["3", "10"], "csrf_token": token,
                                               "next": "/checkpoints?sort=step"})
    html = ask.get_data(as_text=True)
    assert ask.status_code == 200 and "Forget 2 checkpoints?" in html and "Nothing has changed yet" in html
    assert "ONLY copy" in html and "newest protected checkpoint" in html
    assert LAST_COPY.format(grace=web_settings.gc_grace_seconds, keep=web_settings.keep_last) in html
    confirm = html.split('id="bulk-confirm"')[1].split("</form>")[0]
    assert 'name="id" value="3"' in confirm and 'value="10"' not in confirm  # only what can be done
    assert state_of(admin, 3) == "verified"
    done = admin.post("/checkpoints/bulk", data={"action": "forget", "id": ["3"], "confirm": "1",
                                                "csrf_token": token, "next": "/checkpoints?sort=step"})
    html = done.get_data(as_text=True)
    assert "Forget: 1 done" in html and 'href="/checkpoints?sort=step"' in html
    assert state_of(admin, 3) == "forgotten"
    # CSRF like every form; logged out: refused
    assert admin.post("/checkpoints/bulk", data={"action": "pin", "id": ["4"], "csrf_token": "forged",
                                                "confirm": "1"}).status_code == 403
    assert client.application.test_client().post("/checkpoints/bulk", data={"action": "pin", "id": ["4"]}
                                                 ).status_code == 401
    assert not admin.get("/api/checkpoints/4").get_json()["pinned"]
    # nothing checked: back to the list, saying so
    back = admin.post("/checkpoints/bulk", data={"action": "pin", "csrf_token": token, "next": "/checkpoints"})
    assert back.status_code == 303 and back.headers["Location"].endswith("/checkpoints")


def test_bulk_and_sorted_pages_on_each_database(db):
    """webui.bulk and a sorted page's SQL on SQLite and PostgreSQL: a rehearsed pin is rolled
    back, each checkpoint is done or refused alone, a missing step sorts last both ways."""
    from sqlalchemy import update

    from pipeline.db.engine import session_scope
    from pipeline.db.models import Checkpoint
    from webui import bulk as bulk_mod
    from webui import data
    from webui.sorting import CHECKPOINTS, Sort

    _many(db, runs=("alpha",), per_run=6)  # ids 1..6; id 1 failed; 6 newest
    with session_scope(db.db_url) as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == 3).values(step=None, local_present=False))
    rehearsed = bulk_mod.run(db, "pin", [2, 2, 5], note="n", dry_run=True)
    assert [(o.id, o.ok) for o in rehearsed] == [(2, True), (5, True)]  # each once
    assert not any(r["pinned"] for r in data.checkpoints(db))
    forgot = bulk_mod.run(db, "forget", [1, 3, 4, 6])
    assert [(o.id, o.ok, o.only_local_copy) for o in forgot] == [(1, False, False), (3, True, False),
                                                                (4, True, True), (6, False, False)]
    assert [r["state"] for r in data.checkpoints(db) if r["id"] in (3, 4)] == ["forgotten", "forgotten"]
    for desc in (False, True):
        rows = data.checkpoints(db, order=Sort("step", desc).order(CHECKPOINTS))
        assert rows[-1]["id"] == 3  # no step: last, either way
        assert [r["step"] for r in rows[:-1]] == sorted((r["step"] for r in rows[:-1]), reverse=desc)
