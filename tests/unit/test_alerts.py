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
from pipeline.db import workers
from pipeline.db.engine import session_scope
from pipeline.db.models import Alert, Checkpoint, CheckpointFile, ContentCopy, Shard, StorageWorker
from pipeline.db.transitions import create_job, now, transition
from pipeline.detection import catalog, completeness, roots
from pipeline.integrity.retention import forget_checkpoint
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


def settled(s, at=None, **kwargs) -> list[dict]:
    """Evaluate where a condition no longer holds: the first evaluation resolves nothing (a
    condition found again within ``alert_clear_seconds`` is the same alert), one that long after
    resolves it. The events of both."""
    t = at or now()
    first = alerts.refresh(s, t, **kwargs)
    assert not [e for e in first if e["event"] == "resolved"]
    return first + alerts.refresh(s, t + timedelta(seconds=s.alert_clear_seconds), **kwargs)


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
    [r] = resolved(settled(db, now() + timedelta(seconds=1)), "worker_down")
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
    [r] = resolved(settled(db, now() + timedelta(seconds=3700)), "under_replicated")
    assert r["resolved_by"] == repair


def test_a_condition_that_clears_before_its_threshold_leaves_no_row(db):
    seed(db)
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).where(ContentCopy.worker_id == "w-1").values(state="corrupt"))
    assert not alerts.refresh(db)
    assert len(open_rows(db)) == 1
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).values(state="verified"))
    assert not settled(db)  # nobody was told: nothing to resolve, nothing kept
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
    [r] = resolved(settled(db), "run_unprotected")
    assert r["subject"] == run


def fill(s, free: int, *ids: str, filesystem: str | None = None) -> None:
    """The disk of workers ``ids`` (1,000 bytes) with ``free`` bytes free, on ``filesystem``."""
    with session_scope(s.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id.in_(ids or ("w-0",))).values(
            capacity_bytes=1000, free_bytes=free, filesystem=filesystem,
            fs_capacity_bytes=1000 if filesystem else None, fs_free_bytes=free if filesystem else None))


def test_a_disk_above_the_watermark_fires_once_it_held_its_threshold(db):
    seed(db)
    fill(db, 50)
    t = now()
    assert not fired(alerts.refresh(db, t), "disk_full")  # 5 minutes, as docs/alerts.yml's `for: 5m`
    [e] = fired(alerts.refresh(db, t + timedelta(seconds=300)), "disk_full")
    assert e["subject"] == "worker:w-0" and "w-0's disk is 95% full" in e["summary"]
    assert "90% watermark" in e["summary"] and e["link"] == "/workers?q=w-0"


def test_a_disk_hovering_at_the_watermark_is_one_alert_until_it_is_below_the_lower_mark(db):
    """Open above the high watermark (90 %), resolved only below it minus the margin (85 %):
    sweeps at 91 %, 89 %, 91 %... tell the webhook nothing more than once."""
    seed(db)
    t = now()
    fill(db, 50)
    events = alerts.refresh(db, t) + alerts.refresh(db, t + timedelta(seconds=300))
    for i in range(40):  # two sweeps a second, 20 s around the mark, then 5 minutes at 86-89 %
        fill(db, 90 + (10 if i % 2 else -10) if i < 20 else 110 + i % 4 * 10)
        events += alerts.refresh(db, t + timedelta(seconds=301 + i * (0.5 if i < 20 else 15)))
    assert [e["event"] for e in events if e["alert"] == "disk_full"] == ["fired"]
    assert "not yet below 85%" in open_rows(db)[0].summary
    fill(db, 160)  # 84 %
    [r] = resolved(settled(db, t + timedelta(seconds=1000)), "disk_full")
    assert "below 85% again" in r["resolution"]


def test_workers_sharing_a_filesystem_raise_one_disk_alert_naming_them(db):
    """``ckpt up``'s local workers share one disk: one alert for it, as capacity counts it once."""
    seed(db)
    fill(db, 50, "w-0", "w-1", filesystem="boot-1:2049:77")
    t = now()
    alerts.refresh(db, t)
    [e] = fired(alerts.refresh(db, t + timedelta(seconds=300)), "disk_full")
    assert e["subject"] == "boot-1:2049:77" and "storage workers w-0, w-1" in e["summary"]
    assert "filesystem boot-1:2049:77" in e["summary"] and "95% full" in e["summary"]


def test_a_worker_answering_every_other_probe_is_one_alert(db):
    """Down, up, down...: the same occurrence while it keeps coming back within
    alert_clear_seconds, so it fires once after alert_worker_down_seconds (each short outage
    alone would never reach it), and nothing resolves it while it flaps."""
    seed(db)
    t = now()
    events: list[dict] = []
    for i in range(40):
        at = t + timedelta(seconds=10 * i)
        with session_scope(db.db_url) as session:
            session.execute(update(StorageWorker).where(StorageWorker.id == "w-1").values(
                state="down" if i % 2 == 0 else "up", **({"last_seen": at} if i % 2 else {})))
        events += alerts.refresh(db, at)
    assert [e["event"] for e in events if e["alert"] == "worker_down"] == ["fired"]
    [e] = fired(events, "worker_down")
    assert e["fired_at"] - e["since"] >= timedelta(seconds=db.alert_worker_down_seconds)


def down_and_fired(s, worker: str = "w-1") -> None:
    with session_scope(s.db_url) as session:
        session.execute(update(StorageWorker).where(StorageWorker.id == worker)
                        .values(state="down", last_seen=now() - timedelta(hours=1)))
    assert fired(alerts.refresh(s), "worker_down")


def test_a_removed_worker_resolves_its_alert_as_removed_not_as_answered(db):
    seed(db)
    down_and_fired(db)
    with session_scope(db.db_url) as session:  # `ckpt workers remove w-1` (after its checks)
        workers.remove(session, session.get(StorageWorker, "w-1"))
    [r] = resolved(settled(db), "worker_down")
    assert "w-1 was removed" in r["resolution"] and "answered" not in r["resolution"].replace("not answer", "")
    assert r["resolved_by"] is None


def test_a_lost_checkpoint_forgotten_resolves_as_forgotten_not_as_repaired(db):
    ids = seed(db)
    with session_scope(db.db_url) as session:
        session.get(Checkpoint, ids["checkpoint"]).local_present = False
        session.execute(update(ContentCopy).values(state="corrupt"))
    assert fired(alerts.refresh(db), "content_lost")
    with session_scope(db.db_url) as session:  # `ckpt forget` of it
        assert forget_checkpoint(session, ids["checkpoint"], "forgotten by `ckpt forget`")
    [r] = resolved(settled(db), "content_lost")
    assert "1 forgotten" in r["resolution"] and "copies again" not in r["resolution"]


def test_under_replicated_content_of_a_forgotten_checkpoint_resolves_as_not_needed(db):
    ids = seed(db)
    with session_scope(db.db_url) as session:
        session.execute(update(ContentCopy).where(ContentCopy.worker_id == "w-1").values(state="corrupt"))
    t = now()
    alerts.refresh(db, t)
    assert fired(alerts.refresh(db, t + timedelta(seconds=3601)), "under_replicated")
    with session_scope(db.db_url) as session:
        assert forget_checkpoint(session, ids["checkpoint"], "retention policy")
    [r] = resolved(settled(db, t + timedelta(seconds=3700)), "under_replicated")
    assert "no protected checkpoint needs" in r["resolution"] and "copies again" not in r["resolution"]


def test_a_run_whose_unprotected_saves_were_deleted_resolves_as_deleted_not_protected(db):
    seed(db)  # step 1 protected
    second = recorded_only(db, 2)
    t = second.detected_at + timedelta(seconds=3601)
    alerts.refresh(db, second.detected_at)
    assert fired(alerts.refresh(db, t), "run_unprotected")
    with session_scope(db.db_url) as session:  # the watcher found its files deleted
        session.execute(update(Checkpoint).where(Checkpoint.id == second.id).values(store_state="vanished"))
    [r] = resolved(settled(db, t), "run_unprotected")
    assert "deleted from disk" in r["resolution"] and "step_1" not in r["resolution"]
    assert r["resolved_by"] is None


def test_dead_letters_fire_and_an_unreadable_broker_resolves_nothing(db):
    t = now() - timedelta(minutes=5)
    [e] = fired(alerts.refresh(db, dead_letters=(3, t)), "dead_letters")
    assert e["since"] == t and e["summary"].startswith("3 dead letter(s)") and e["link"] == "/dead-letters"
    assert not alerts.refresh(db, dead_letters=None)  # the broker could not be read: left as it is
    assert [r.alert for r in open_rows(db)] == ["dead_letters"]
    [r] = resolved(settled(db, dead_letters=(0, None)), "dead_letters")
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
    [r] = resolved(settled(s), "scrub_overdue")
    assert r["subject"] == "w-0" and r["resolved_by"] == scrub
    assert [a.subject for a in open_rows(s)] == ["w-1"]


def test_a_scrub_overdue_on_a_removed_worker_or_with_the_schedule_off_says_so_not_scrubbed(db):
    s = dataclasses.replace(db, scrub_cron="30 2 * * *")
    seed(s)
    with session_scope(s.db_url) as session:
        session.execute(update(Checkpoint).values(detected_at=now() - timedelta(days=4)))
    assert len(fired(alerts.refresh(s), "scrub_overdue")) == 2
    with session_scope(s.db_url) as session:
        workers.remove(session, session.get(StorageWorker, "w-0"))
    [r] = resolved(settled(s), "scrub_overdue")
    assert r["subject"] == "w-0" and "w-0 was removed" in r["resolution"] and "was scrubbed" not in r["resolution"]
    [r] = resolved(settled(dataclasses.replace(s, scrub_cron="")), "scrub_overdue")
    assert r["subject"] == "w-1" and "scrub schedule was turned off" in r["resolution"]


def test_a_full_disk_whose_worker_was_removed_says_so_not_below_the_mark(db):
    seed(db)
    fill(db, 50, "w-1")
    t = now()
    alerts.refresh(db, t)
    assert fired(alerts.refresh(db, t + timedelta(seconds=300)), "disk_full")
    with session_scope(db.db_url) as session:
        workers.remove(session, session.get(StorageWorker, "w-1"))
    [r] = resolved(settled(db, t + timedelta(seconds=400)), "disk_full")
    assert "w-1 was removed" in r["resolution"] and "below" not in r["resolution"]


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
    assert resolved(settled(db), "worker_down")
