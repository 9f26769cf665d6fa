"""Per-run counts by state kept as data (``run_state_counts``, migrations/versions/0016), on
SQLite and PostgreSQL: after every kind of change a checkpoint's state goes through (detected,
each store step, superseded by new content at its path, vanished, rotated, forgotten, back at
its path), the counts the overview and ``/metrics`` read equal a recount of the checkpoints.
(The lifecycle model, tests/model/world.py, checks the same after each of its steps.)"""
from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import text

from pipeline.db.engine import get_engine, session_scope
from pipeline.db.migrate import alembic_config
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import transition
from pipeline.detection import catalog, completeness, roots
from pipeline.integrity.retention import forget_checkpoint
from pipeline.settings import Settings
from pipeline.status import run_facts
from tests.checkpoints import atomic_save, state_dict
from tests.counts import Counts, kept, recount
from tests.unit.test_migrations import insert_checkpoint, insert_jobs


def assert_counts_match(url: str) -> Counts:
    with session_scope(url, readonly=True) as s:
        now_kept, now_counted = kept(s), recount(s)
    assert now_kept == now_counted
    return now_kept


def _record(settings: Settings, name: str, seed: int) -> tuple[int, int]:
    """Save a real file under run r1 and record it as detection does: (checkpoint id, job id)."""
    run_dir = Path(settings.roots[0].rstrip("*")) / "r1"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = atomic_save(state_dict(seed), run_dir / name)
    run, ckpt_path = roots.locate(path, settings.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path),
                                       shard_size=settings.shard_size)
    with session_scope(settings.db_url) as s:
        ckpt, job, _ = catalog.record(s, detected, lease_seconds=60, detail="test")
        return ckpt.id, job.id


def _store(url: str, job_id: int) -> None:
    for a, b in (("detected", "sharded"), ("sharded", "replicated"), ("replicated", "verified")):
        with session_scope(url) as s:
            transition(s, job_id, "store", a, b)
        assert_counts_match(url)


def test_counts_stay_equal_to_a_recount_through_every_kind_of_state_change(db):
    url = db.db_url
    a, job_a = _record(db, "a.safetensors", 1)
    b, job_b = _record(db, "b.safetensors", 2)
    c, job_c = _record(db, "c.safetensors", 3)
    assert assert_counts_match(url)  # detected, three of them
    for job in (job_a, job_b, job_c):
        _store(url, job)

    with session_scope(url) as s:  # rotated: what rotation writes, in its one transaction
        ckpt = s.get(Checkpoint, a)
        ckpt.local_present, ckpt.local_gone = False, "rotated"
        transition(s, job_a, "store", "verified", "rotated")
    assert_counts_match(url)

    with session_scope(url) as s:  # forgotten by a retention policy
        assert forget_checkpoint(s, a, "test")
    assert_counts_match(url)

    with session_scope(url) as s:  # the watcher finds a protected one gone: still verified, no local copy
        catalog.mark_vanished(s, s.get(Checkpoint, b))
    assert_counts_match(url)

    d, job_d = _record(db, "d.safetensors", 4)
    with session_scope(url) as s:  # vanished before it was protected
        catalog.mark_vanished(s, s.get(Checkpoint, d))
    assert_counts_match(url)

    c2, job_c2 = _record(db, "c.safetensors", 5)  # new content at c's path: c superseded, not current
    counts = assert_counts_match(url)
    with session_scope(url, readonly=True) as s:
        assert not s.get(Checkpoint, c).current
    _store(url, job_c2)

    back, _job = _record(db, "c.safetensors", 3)  # c's content saved again: current again, stored again
    assert back == c
    counts = assert_counts_match(url)
    run = str(Path(db.roots[0].rstrip("*")) / "r1")
    assert counts == {(run, "detected", True): (1, counts[(run, "detected", True)][1]),
                      (run, "forgotten", False): (1, counts[(run, "forgotten", False)][1]),
                      (run, "verified", False): (1, counts[(run, "verified", False)][1]),
                      (run, "vanished", False): (1, counts[(run, "vanished", False)][1])}

    with session_scope(url) as s:  # and what the overview reads is the same
        facts = run_facts(s)
    assert facts[run]["count"] == 4
    assert facts[run]["by_state"] == {"detected": 1, "forgotten": 1, "verified": 1, "vanished": 1}
    with session_scope(url) as s:  # rows deleted (as a test or a repair might): counted down
        s.execute(text("DELETE FROM job_events"))
        s.execute(text("DELETE FROM jobs"))
        for table in ("shards", "checkpoint_files", "checkpoint_parts"):
            s.execute(text(f"DELETE FROM {table}"))
        s.execute(text("DELETE FROM checkpoints WHERE id = :i"), {"i": d})
    assert assert_counts_match(url) == {k: v for k, v in counts.items() if k[1] != "vanished"}


def test_0016_fills_the_counts_from_existing_checkpoints(db):
    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0014")
        conn.commit()
        for i in (1, 2, 3, 4):
            insert_checkpoint(conn, i)
        conn.execute(text("UPDATE checkpoints SET store_state = 'verified' WHERE id IN (1, 2)"))
        conn.execute(text("UPDATE checkpoints SET store_state = 'detected', total_bytes = 5 WHERE id = 3"))
        conn.execute(text("UPDATE checkpoints SET store_state = 'verified', current = false WHERE id = 4"))
        insert_jobs(conn, [(1, "store", 1, "verified")])
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
    try:
        assert assert_counts_match(db.db_url) == {("/r", "verified", True): (2, 2), ("/r", "detected", True): (1, 5)}
    finally:
        with get_engine(db.db_url).connect() as conn:  # the other tests start from an empty database
            for table in ("jobs", "checkpoints", "run_state_counts"):
                conn.execute(text(f"DELETE FROM {table}"))
            conn.commit()
