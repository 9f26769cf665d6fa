"""Alerts (pipeline/alerts.py): each condition, evaluated from real rows of a control plane built
by the migrations (SQLite, and PostgreSQL when there is one), fires after its threshold, is
resolved by the job that repaired it, and a condition that clears before its threshold leaves
nothing."""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from pipeline import alerts, degraded
from pipeline.db.engine import session_scope
from pipeline.db.models import Alert, Checkpoint, CheckpointFile, ContentCopy, Shard, StorageWorker
from pipeline.db.transitions import create_job, now, transition
from pipeline.detection import catalog, completeness, roots
from tests.checkpoints import atomic_save, state_dict
from tests.webui.conftest import seed


@pytest.fixture(autouse=True)
def run_dir(settings):
    """The run the seeded checkpoints are written in."""
    (Path(settings.roots[0].rstrip("*")) / "r1").mkdir(parents=True, exist_ok=True)


def fired(events: list[dict], alert: str) -> list[dict]:
    return [e for e in events if e["event"] == "fired" and e["alert"] == alert]


def resolved(events: list[dict], alert: str) -> list[dict]:
    return [e for e in events if e["event"] == "resolved" and e["alert"] == alert]


def open_rows(s) -> list[Alert]:
    with session_scope(s.db_url) as session:
        rows = session.scalars(select(Alert).where(Alert.resolved_at.is_(None))).all()
        session.expunge_all()
        return list(rows)


def shas_of(s, checkpoint_id: int) -> list[str]:
    with session_scope(s.db_url) as session:
        return list(session.scalars(select(Shard.sha256).join(CheckpointFile)
                                    .where(CheckpointFile.checkpoint_id == checkpoint_id)))


def done_job(s, kind: str, steps: list[tuple[str, str]], *, params: dict | None = None, sha: str | None = None,
             detail: str = "done") -> int:
    with session_scope(s.db_url) as session:
        job = create_job(session, kind, checkpoint_id=None, params=params or {}, sha256=sha)
        for a, b in steps:
            transition(session, job.id, kind, a, b, detail=detail)
        return job.id


def recorded_only(s, step: int) -> Checkpoint:
    """A checkpoint detected and recorded (store job `detected`), not protected."""
    path = atomic_save(state_dict(step), Path(s.roots[0].rstrip("*")) / "r1" / f"step_{step}.safetensors")
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as session:
        ckpt, _job, _ = catalog.record(session, detected, lease_seconds=60, detail="recorded")
        session.flush()
        session.expunge(ckpt)
        return ckpt


def test_a_worker_down_fires_after_its_threshold_and_its_reconcile_resolves_it(db):
    seed(db)
    t = now()
    with session_scope(db.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == "w-1")
                        .values(state="down", last_seen=t - timedelta(seconds=100), last_error="connection refused"))
    assert not fired(alerts.refresh(db, t), "worker_down")  # down 100 s: not yet (300 s)
    assert "worker_down" in [r.alert for r in open_rows(db)]  # (its copies no longer count: under-replicated too)
    events = alerts.refresh(db, t + timedelta(seconds=201))
    [e] = fired(events, "worker_down")
    assert e["subject"] == "w-1" and e["severity"] == "warning" and "connection refused" in e["summary"]
    assert e["since"] == t - timedelta(seconds=100) and e["link"] == "/workers?q=w-1"
    assert alerts.active(db)["alerts"][0]["subject"] == "w-1"
    assert not alerts.refresh(db, t + timedelta(seconds=230))  # fired once, not at every evaluation

    with session_scope(db.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == "w-1").values(state="up", last_seen=now()))
    reconcile = done_job(db, "reconcile", [("queued", "reconciling"), ("reconciling", "done")],
                         params={"worker_id": "w-1"})
    [r] = resolved(alerts.refresh(db, now() + timedelta(seconds=1)), "worker_down")
    assert r["resolved_by"] == reconcile and "w-1 answered again" in r["resolution"]
    assert alerts.active(db)["alerts"] == []


def test_content_lost_fires_at_once_and_is_critical(db):
    ids = seed(db)
    with session_scope(db.db_url) as session:
        session.get(Checkpoint, ids["checkpoint"]).local_present = False
        session.execute(update(ContentCopy).values(state="corrupt"))
    [e] = fired(alerts.refresh(db), "content_lost")
    assert e["severity"] == "critical" and e["summary"].startswith("1 checkpoint(s) LOST")
    assert e["link"] == "/health?problems=1"


def test_under_replicated_content_fires_after_an_hour_and_its_repair_resolves_it(db):
    ids = seed(db)
    shas = shas_of(db, ids["checkpoint"])
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).where(ContentCopy.worker_id == "w-1").values(state="corrupt"))
    t = now()
    assert not alerts.refresh(db, t)
    assert not alerts.refresh(db, t + timedelta(seconds=3000))
    [e] = fired(alerts.refresh(db, t + timedelta(seconds=3601)), "under_replicated")
    assert e["since"] == t and f"{len(set(shas))} content(s)" in e["summary"]

    repair = done_job(db, "repair", [("queued", "repairing"), ("repairing", "done")], sha=shas[0],
                      params={"sha256": shas[0], "reason": "scrub of w-1 found its copy bad"})
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).values(state="verified"))
    [r] = resolved(alerts.refresh(db, now() + timedelta(seconds=3700)), "under_replicated")
    assert r["resolved_by"] == repair


def test_a_condition_that_clears_before_its_threshold_leaves_no_row(db):
    seed(db)
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).where(ContentCopy.worker_id == "w-1").values(state="corrupt"))
    assert not alerts.refresh(db)
    assert len(open_rows(db)) == 1
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).values(state="verified"))
    assert not alerts.refresh(db)  # nobody was told: nothing to resolve, nothing kept
    with session_scope(db.db_url) as session:
        assert session.scalars(select(Alert)).all() == []


def test_a_run_whose_newest_save_stays_unprotected_fires_since_it_fell_behind(db):
    seed(db)  # step 1 protected
    second = recorded_only(db, 2)
    third = recorded_only(db, 3)
    t = now()
    assert not fired(alerts.refresh(db, t), "run_unprotected")
    [e] = fired(alerts.refresh(db, second.detected_at + timedelta(seconds=3601)), "run_unprotected")
    assert e["subject"] == second.run and e["since"] == second.detected_at  # not the newest save's time
    assert "step_3.safetensors is detected, not protected" in e["summary"]
    assert e["link"].startswith("/runs?name=") and third.detected_at >= second.detected_at


def test_a_run_whose_trainer_cannot_protect_its_saves_fires(db):
    seed(db)
    run = str(Path(db.roots[0].rstrip("*")) / "r1")
    db.home.mkdir(parents=True, exist_ok=True)  # the ledger is kept in the home (PostgreSQL keeps nothing there)
    degraded.note(db.home, run, "no ckpt up is running", at=now() - timedelta(hours=2))
    [e] = fired(alerts.refresh(db), "run_unprotected")
    assert e["subject"] == run and "protection degraded" in e["summary"] and "no ckpt up" in e["summary"]
    degraded.clear(db.home, run)
    [r] = resolved(alerts.refresh(db), "run_unprotected")
    assert r["subject"] == run


def test_a_disk_above_the_watermark_fires(db):
    seed(db)
    with session_scope(db.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == "w-0")
                        .values(capacity_bytes=1000, free_bytes=50))
    [e] = fired(alerts.refresh(db), "disk_full")
    assert e["subject"] == "w-0" and "95% full" in e["summary"] and "90% watermark" in e["summary"]


def test_dead_letters_fire_and_an_unreadable_broker_resolves_nothing(db):
    t = now() - timedelta(minutes=5)
    [e] = fired(alerts.refresh(db, dead_letters=(3, t)), "dead_letters")
    assert e["since"] == t and e["summary"].startswith("3 dead letter(s)") and e["link"] == "/dead-letters"
    assert not alerts.refresh(db, dead_letters=None)  # the broker could not be read: left as it is
    assert [r.alert for r in open_rows(db)] == ["dead_letters"]
    [r] = resolved(alerts.refresh(db, dead_letters=(0, None)), "dead_letters")
    assert r["resolved_by"] is None and "no dead letter left" in r["resolution"]


def test_a_scrub_overdue_fires_per_worker_and_its_scrub_resolves_it(db):
    s = dataclasses.replace(db, scrub_cron="30 2 * * *")
    seed(s)
    with session_scope(s.db_url) as session:  # recorded four days ago: nightly scrubs were due since
        session.execute(update(Checkpoint).values(detected_at=now() - timedelta(days=4)))
    assert not alerts.refresh(dataclasses.replace(s, scrub_cron=""))  # no schedule: never overdue
    events = fired(alerts.refresh(s), "scrub_overdue")
    assert sorted(e["subject"] for e in events) == ["w-0", "w-1"]
    assert "never scrubbed" in events[0]["summary"] and events[0]["link"] == "/jobs?kind=scrub"
    scrub = done_job(s, "scrub", [("queued", "scrubbing"), ("scrubbing", "done")], params={"worker_id": "w-0"})
    [r] = resolved(alerts.refresh(s), "scrub_overdue")
    assert r["subject"] == "w-0" and r["resolved_by"] == scrub
    assert [a.subject for a in open_rows(s)] == ["w-1"]


def test_no_alert_when_all_is_well(db):
    seed(db)
    assert alerts.refresh(db) == []
    assert alerts.active(db)["alerts"] == [] and alerts.active(db)["evaluated_at"] is not None
    assert alerts.counts(db) == {k: 0 for k in alerts.KINDS}


def test_incidents_show_a_repair_with_the_scrub_that_found_it(db):
    ids = seed(db)
    sha = shas_of(db, ids["checkpoint"])[0]
    scrub = done_job(db, "scrub", [("queued", "scrubbing"), ("scrubbing", "done")], params={"worker_id": "w-0"})
    repair = done_job(db, "repair", [("queued", "repairing"), ("repairing", "done")], sha=sha,
                      params={"sha256": sha, "reason": "scrub of w-0 found its copy bad", "found_by": scrub},
                      detail="1 copies rebuilt and verified")
    [i] = alerts.incidents(db)
    assert i["found_by"] == scrub and i["resolved_by"] == repair and i["kind"] == "damaged copy"
    assert "scrub of w-0 found its copy bad" in i["what"] and "1 copies rebuilt and verified" in i["resolution"]


def test_a_check_that_fails_leaves_its_open_alerts_as_they_are(db, monkeypatch):
    seed(db)
    with session_scope(db.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == "w-1")
                        .values(state="down", last_seen=now() - timedelta(hours=1)))
    assert fired(alerts.refresh(db), "worker_down")
    with session_scope(db.db_url) as session:
        session.execute(update(StorageWorker).values(state="up"))

    def broken(*args):
        raise RuntimeError("a bad row")

    monkeypatch.setitem(alerts.CHECKS, "worker_down", broken)
    assert not resolved(alerts.refresh(db), "worker_down")  # a failure to look is not "all is well"
    assert "worker_down" in [r.alert for r in open_rows(db)]
    monkeypatch.undo()
    assert resolved(alerts.refresh(db), "worker_down")
