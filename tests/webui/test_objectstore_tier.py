"""The web UI shows the object stores as a tier of their own: the workers page, the overview and
``/api/workers`` list them apart from the storage workers (url, endpoint, state, used against
the quota, copies, and the last error that says why copies wait, escaped); a checkpoint's page
and ``/api/checkpoints/<id>`` show each shard's object-store copy state beside the workers'
replicas, and the line ``ckpt status`` prints (pipeline.objectstore.report)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
from markupsafe import escape
from sqlalchemy import select

from pipeline import settings as settings_mod
from pipeline import status
from pipeline.db import copies, workers
from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, Content, Shard
from pipeline.objectstore import report
from tests.webui.conftest import seed

ARCHIVE = {"name": "archive", "url": "s3://ckpt-archive/team-a", "endpoint": "http://127.0.0.1:8333",
           "region": "us-east-1", "quota_bytes": 10**9}
COLD = {"name": "cold", "url": "s3://ckpt-cold", "region": "us-east-1"}  # no endpoint: AWS S3 itself
#: What a store said, as hostile as a message quoting a server's answer may be.
THROTTLED = 'throttled (503 SlowDown) <script>alert("copy")</script>'
REFUSED = "credentials refused (profile 'ckpt'): <img src=x onerror=alert(1)> & rotate them"


@pytest.fixture
def tiered(web_settings):
    """Two storage workers holding a verified checkpoint; object store ``archive`` (up) holds a
    copy of its shards: the first confirmed, the second pending after a throttled put, the third
    found missing, the fourth corrupt; ``cold`` is down, its credentials refused, and holds the
    fifth's copy, pending; the sixth's copy is put on ``archive``, not confirmed yet; the others
    have none."""
    s = settings_mod.configure(dataclasses.replace(web_settings, targets=json.dumps([ARCHIVE, COLD])))
    ids = seed(s)
    with session_scope(s.db_url) as session:
        for t, quota in ((ARCHIVE, ARCHIVE["quota_bytes"]), (COLD, 0)):
            w = workers.add(session, f"target:{t['name']}", t["url"], source="target", zone=f"objectstore:{t['name']}")
            w.tier, w.capacity_bytes = "objectstore", quota
            workers.set_state(session, w, "up")
        session.flush()
        workers.set_state(session, session.get(type(w), "target:cold"), "down", error=REFUSED)
        shas = list(session.scalars(select(Shard.sha256).join(CheckpointFile)
                                    .where(CheckpointFile.checkpoint_id == ids["checkpoint"]).order_by(Shard.seq)))
        assert len(set(shas)) >= 7, "the seeded checkpoint has at least seven distinct shards"
        rows = [copies.new_copy(session.get(Content, sha), "target:archive") for sha in (*shas[:4], shas[5])]
        copies.new_copy(session.get(Content, shas[4]), "target:cold")  # placed, on a store that refuses
        session.flush()
        for row in (*rows[:3], rows[4]):  # the sixth's is put, not confirmed yet
            copies.move(session, row, "stored")
        copies.move(session, rows[0], "verified")
        copies.move(session, rows[1], "pending", error=THROTTLED)  # sent again: its put was throttled
        copies.move(session, rows[2], "missing")
        copies.move(session, rows[3], "corrupt")
    return s, ids, shas


@pytest.fixture
def tiered_client(tiered):
    from webui import create_app

    return create_app({"TESTING": True}, settings=tiered[0]).test_client()


def table(page: str, table_id: str) -> str:
    m = re.search(rf'<table id="{table_id}">(.*?)</table>', page, re.S)
    assert m, f"no table {table_id}"
    return m.group(1)


def test_workers_page_and_api_list_object_stores_apart_with_why_their_copies_wait(tiered, tiered_client):
    page = tiered_client.get("/workers").get_data(as_text=True)
    assert "target:" not in table(page, "workers")  # the workers' tier lists storage workers only
    assert "w-0" in table(page, "workers")
    stores = table(page, "objectstores")
    archive, cold = stores.split("<td>target:archive</td>")[1].split("<td>target:cold</td>")
    assert "s3://ckpt-archive/team-a" in archive and "http://127.0.0.1:8333" in archive
    assert "up" in archive and "of 1.0 GB quota" in archive and '<td class="num">2</td>' in archive
    assert "AWS S3" in cold and "down" in cold and "(no quota)" in cold
    assert str(escape(REFUSED)) in cold and "<img" not in page  # the reason, escaped

    api = tiered_client.get("/api/workers").get_json()
    assert {w["id"] for w in api["workers"]} == {"w-0", "w-1"}
    by_id = {o["id"]: o for o in api["objectstores"]}
    used = by_id["target:archive"].pop("used_bytes")
    assert by_id["target:archive"] == {"id": "target:archive", "url": ARCHIVE["url"], "endpoint": ARCHIVE["endpoint"],
                                       "state": "up", "quota_bytes": 10**9, "copies": 2, "last_error": None}
    assert used > 0
    assert by_id["target:cold"]["last_error"] == REFUSED and by_id["target:cold"]["endpoint"] == ""
    assert [o["id"] for o in tiered_client.get("/api/workers?q=refused").get_json()["objectstores"]] == ["target:cold"]

    overview = tiered_client.get("/").get_data(as_text=True)
    assert re.search(r'id="objectstores-card"><h2>Object stores</h2><p class="big">1 of 2 up', overview)
    assert "target:cold" in table(overview, "objectstores") and "<img" not in overview
    assert tiered_client.get("/api/health").get_json()["workers"] == ["w-0", "w-1"]  # the matrix counts workers


def test_checkpoint_page_shows_each_shards_object_store_copy_and_the_status_line(tiered, tiered_client):
    s, ids, shas = tiered
    cid = ids["checkpoint"]
    (row,) = [c for c in status.status(s)["checkpoints"] if c["id"] == cid]
    line = report.words(row["objectstore"])  # what `ckpt status` prints
    assert line == f"object store: 1/{len(set(shas))} contents confirmed, lagging"

    doc = tiered_client.get(f"/api/checkpoints/{cid}").get_json()
    assert doc["objectstore_line"] == line and doc["objectstore"] == row["objectstore"]
    shards = [sh for f in doc["files"] for sh in f["shards"]]
    state = {sh["sha256"]: sh["objectstore"] for sh in shards}
    assert [state[sha]["state"] for sha in shas[:4]] == ["confirmed", "pending", "missing", "corrupt"]
    assert state[shas[4]]["copies"][0] == {
        "target": "target:cold", "state": "pending", "health": "missing", "last_error": REFUSED, "verified_at": None}
    assert state[shas[5]]["state"] == "pending" and state[shas[5]]["copies"][0]["health"] == "unverified"
    assert all(state[sha]["state"] == "missing" and not state[sha]["copies"] for sha in shas[6:])
    assert state[shas[1]]["error"] == THROTTLED and state[shas[0]]["error"] is None
    # a copy on a store that refuses, or none placed: the store's error says why
    assert all(state[sha]["error"] == REFUSED for sha in (shas[4], *shas[6:]))
    # the one rule: the shards shown confirmed are the contents report.confirmed counts
    assert len({sha for sha, o in state.items() if o["state"] == "confirmed"}) == row["objectstore"]["confirmed"]
    assert all(r["worker_id"].startswith("w-") for sh in shards for r in sh["replicas"])  # the workers' replicas

    page = tiered_client.get(f"/checkpoints/{cid}").get_data(as_text=True)
    assert f'<dd id="objectstore-line" class="warn">{line}</dd>' in page
    cells = re.findall(r'<td class="objectstore"><span class="cell (\w+)">', page)
    assert cells.count("confirmed") == 1 and {"pending", "missing", "corrupt"} <= set(cells)
    assert str(escape(THROTTLED)) in page and "<script>alert" not in page and "<img" not in page


def test_a_checkpoint_whose_run_wants_no_object_store_copy_shows_none(web_settings, client):
    ids = seed(web_settings)
    doc = client.get(f"/api/checkpoints/{ids['checkpoint']}").get_json()
    assert doc["objectstore_line"] is None
    assert all(sh["objectstore"] is None for f in doc["files"] for sh in f["shards"])
    page = client.get(f"/checkpoints/{ids['checkpoint']}").get_data(as_text=True)
    assert "objectstore-line" not in page and "<th>object store</th>" not in page
    assert "objectstores" not in client.get("/workers").get_data(as_text=True)
