"""The nightly scrub schedule, with a controllable clock."""
from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job, StorageWorker
from pipeline.service.scheduler import last_fire, nightly_scrub

UTC = UTC
CRON = "30 2 * * *"


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)


def test_last_fire_is_the_latest_0230_at_or_before_now():
    assert last_fire(CRON, at(21, 2, 29), UTC) == at(20, 2, 30)
    assert last_fire(CRON, at(21, 2, 30), UTC) == at(21, 2, 30)
    assert last_fire(CRON, at(21, 23, 0), UTC) == at(21, 2, 30)


def _world(db, protected_since: datetime):
    s = dataclasses.replace(db, scrub_cron=CRON)
    with session_scope(s.db_url) as session:
        for i in range(2):
            session.add(StorageWorker(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", source="static", state="up"))
        session.add(Checkpoint(path="/r/a", run="/r", name="a", is_dir=False, version="v", mtime=0.0,
                               total_bytes=1, local_present=True, detected_at=protected_since))
    return s


def scrub_jobs(s) -> list[Job]:
    with session_scope(s.db_url) as session:
        return list(session.scalars(select(Job).where(Job.kind == "scrub").order_by(Job.id)))


def test_fires_once_per_day_and_collapses_double_fires(db):
    s = _world(db, at(1, 0))
    assert len(nightly_scrub(s, at(20, 2, 30), UTC)) == 2  # one job per worker
    assert nightly_scrub(s, at(20, 2, 30), UTC) == []       # the same fire again: collapsed
    assert nightly_scrub(s, at(20, 14, 0), UTC) == []       # later that day: nothing new
    assert len(nightly_scrub(s, at(21, 2, 31), UTC)) == 2   # next night
    keys = [j.dedupe_key for j in scrub_jobs(s)]
    assert keys == ["nightly:2026-11-20:w0", "nightly:2026-11-20:w1", "nightly:2026-11-21:w0", "nightly:2026-11-21:w1"]


def test_a_missed_run_is_caught_up_once(db):
    s = _world(db, at(1, 0))
    # The machine was off from the 18th to the 21st at 09:00: one catch-up, for the latest night.
    assert len(nightly_scrub(s, at(21, 9, 0), UTC)) == 2
    assert nightly_scrub(s, at(21, 9, 1), UTC) == []
    assert {j.dedupe_key.split(":")[1] for j in scrub_jobs(s)} == {"2026-11-21"}


def test_nothing_to_scrub_before_anything_was_protected(db):
    s = _world(db, at(21, 8, 0))  # first checkpoint after last night's fire time
    assert nightly_scrub(s, at(21, 9, 0), UTC) == []
    assert len(nightly_scrub(s, at(22, 2, 30), UTC)) == 2


def test_an_empty_cron_disables_the_nightly_scrub(db):
    s = dataclasses.replace(_world(db, at(1, 0)), scrub_cron="")
    assert nightly_scrub(s, at(21, 9, 0), UTC) == []
    assert nightly_scrub(s, at(21, 9, 0) + timedelta(days=1), UTC) == []
