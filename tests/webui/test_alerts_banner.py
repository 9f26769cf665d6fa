"""The alert banner and GET /api/alerts read what the scheduler's evaluation left
(pipeline/alerts.py); a banner whose alerts were not evaluated lately says so."""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from pipeline import alerts
from pipeline.db.engine import session_scope
from pipeline.db.models import Lock, StorageWorker
from pipeline.db.transitions import now
from tests.webui.conftest import seed


def test_the_banner_lists_what_fired_and_the_api_says_the_same(client, web_settings):
    seed(web_settings)
    with session_scope(web_settings.db_url) as s:
        s.execute(update(StorageWorker).where(StorageWorker.id == "w-1")
                  .values(capacity_bytes=100, free_bytes=1))
    t = now()
    alerts.refresh(web_settings, t - timedelta(seconds=web_settings.alert_disk_full_seconds), dead_letters=(0, None))
    alerts.refresh(web_settings, t, dead_letters=(0, None))  # above the mark for 5 minutes: fired
    page = client.get("/workers").get_data(as_text=True)
    assert 'id="alerts"' in page and "storage worker w-1&#39;s disk is 99% full" in page
    assert 'href="/workers?q=w-1"' in page and "alerts-stale" not in page
    doc = client.get("/api/alerts").get_json()
    assert [(a["alert"], a["subject"], a["severity"]) for a in doc["alerts"]] == [
        ("disk_full", "worker:w-1", "warning")]  # one alert per disk: w-1 does not say which it is on
    assert doc["evaluated_at"].endswith("Z") and doc["incidents"][0]["kind"] == "disk above its watermark"


def test_a_banner_not_evaluated_lately_asks_whether_the_scheduler_runs(client, web_settings):
    alerts.refresh(web_settings, dead_letters=(0, None))
    assert 'id="alerts"' not in client.get("/").get_data(as_text=True)  # all is well: no banner
    with session_scope(web_settings.db_url) as s:
        s.execute(update(Lock).where(Lock.name == alerts.EVALUATED).values(expires_at=now() - timedelta(hours=1)))
    page = client.get("/").get_data(as_text=True)
    assert 'id="alerts-stale"' in page and "is the scheduler running?" in page
