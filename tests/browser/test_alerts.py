"""Alerts in Chromium: the banner on every page (severity, what, since when, a link that leads to
the page showing it; none when all is well) and the incidents page (a damaged copy found by a
scrub and rebuilt by a repair; a worker that went down and was reconciled), at a wide and a
phone's width.

The rows are written straight into a real control plane, the alerts evaluated as the scheduler
does (pipeline.alerts.refresh, with the real broker's dead letters), and the real web app is
served over HTTP on loopback. Screenshots: ``<tmp>/*.png`` (``CKPT_SCREENSHOTS=dir`` keeps a copy).
"""
from __future__ import annotations

import os
import shutil
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update
from werkzeug.serving import make_server

from pipeline import alerts
from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointFile, Shard, StorageWorker
from pipeline.db.transitions import now
from pipeline.service.scheduler import dead_letter_summary
from tests.browser.test_ui import fits
from tests.unit.test_alerts import done_job
from tests.webui.conftest import seed
from tests.webui.test_api import dead_letter

pytestmark = [pytest.mark.integration, pytest.mark.browser]


@pytest.fixture
def served(web_settings):
    from webui import create_app

    server = make_server("127.0.0.1", 0, create_app({}, settings=web_settings), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)


def evaluate(s, at=None) -> list[dict]:
    return alerts.refresh(s, at, dead_letters=dead_letter_summary(s))


@pytest.mark.parametrize("width", [1400, 420])
def test_the_banner_and_the_incidents_page_in_the_browser(served, web_settings, browser, width, tmp_path):
    base, s = served, web_settings
    ids = seed(s)
    page = browser.new_page(viewport={"width": width, "height": 900})
    keep = os.environ.get("CKPT_SCREENSHOTS")

    def shot(name: str) -> None:
        out = tmp_path / f"{name}-{width}px.png"
        fits(page, out, name, width)
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(out, Path(keep) / out.name)

    # All is well: no banner on any page.
    assert evaluate(s) == []
    for path in ("/", "/checkpoints", "/workers", "/incidents"):
        page.goto(base + path)
        assert page.locator("#alerts").count() == 0, path
    assert "No incident" in page.inner_text("#incidents")

    # A worker down for an hour and a dead letter: both on the banner of every page.
    with session_scope(s.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == "w-1")
                        .values(state="down", last_seen=now() - timedelta(hours=1), last_error="connection refused"))
    dead_letter()
    fired = {e["alert"] for e in evaluate(s) if e["event"] == "fired"}
    assert {"worker_down", "dead_letters"} <= fired
    for path in ("/", "/checkpoints", f"/checkpoints/{ids['checkpoint']}", "/jobs", "/health"):
        page.goto(base + path)
        banner = page.inner_text("#alerts")
        assert "storage worker w-1 is down: connection refused" in banner, path
        assert "1 dead letter(s)" in banner and "WARNING" in banner.upper(), path
        assert page.locator("#alerts time").count() >= 2  # since when, in the browser's time zone
    page.goto(base + "/")
    shot("banner")
    with page.expect_navigation(wait_until="load"):
        page.locator("#alerts p", has_text="w-1 is down").locator("a").click()
    assert page.url.endswith("/workers?q=w-1") and "w-1" in page.inner_text("#workers")

    # The worker comes back and is reconciled; a scrub finds a copy bad and a repair rebuilds it.
    with session_scope(s.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == "w-1").values(state="up", last_seen=now()))
        sha = session.scalars(select(Shard.sha256).join(CheckpointFile)
                              .where(CheckpointFile.checkpoint_id == ids["checkpoint"])).first()
    reconcile = done_job(s, "reconcile", [("queued", "reconciling"), ("reconciling", "done")],
                         params={"worker_id": "w-1"})
    scrub = done_job(s, "scrub", [("queued", "scrubbing"), ("scrubbing", "done")], params={"worker_id": "w-0"})
    repair = done_job(s, "repair", [("queued", "repairing"), ("repairing", "done")], sha=sha,
                      params={"sha256": sha, "reason": "scrub of w-0 found its copy bad", "found_by": scrub},
                      detail="1 copies rebuilt and verified")
    from pipeline.tasks import deadletters

    deadletters.requeue(s, None)
    evaluate(s)  # gone for a moment: kept open, in case it is found again (alert_clear_seconds)
    resolved = {e["alert"] for e in evaluate(s, now() + timedelta(seconds=s.alert_clear_seconds))
                if e["event"] == "resolved"}
    assert {"worker_down", "dead_letters"} <= resolved

    page.goto(base + "/")
    assert page.locator("#alerts").count() == 0  # all is well again: no banner
    with page.expect_navigation(wait_until="load"):
        page.click("header nav a:text('Incidents')")
    table = page.locator("#incidents")
    repair_row = table.locator("tr.repair", has_text="scrub of w-0 found its copy bad")
    assert repair_row.count() == 1
    assert f"job {scrub}" in repair_row.inner_text() and "1 copies rebuilt and verified" in repair_row.inner_text()
    assert repair_row.locator("a.resolved-by").get_attribute("href").endswith(f"/jobs/{repair}")
    down_row = table.locator("tr.alert", has_text="storage worker w-1 is down")
    assert down_row.count() == 1 and f"reconcile job {reconcile}" in down_row.inner_text()
    assert down_row.locator("a.resolved-by").get_attribute("href").endswith(f"/jobs/{reconcile}")
    assert table.locator("tr.alert", has_text="dead letter").count() == 1
    shot("incidents")
    with page.expect_navigation(wait_until="load"):
        repair_row.locator("a.resolved-by").click()
    assert page.url.endswith(f"/jobs/{repair}")
    page.close()
