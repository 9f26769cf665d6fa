"""The workers' RF per run, and of a content shared by runs (pipeline/db/content_rf.py).

Given runs with their own ``rf`` (``[runs."<glob>"]`` tables) sharing contents, When a content's
RF is asked (in Python, and as the SQL the sweeps use), Then it is the largest RF of the runs
whose live checkpoints reference it, the global RF when none does, and a forgotten checkpoint's
run no longer counts. The sweeps built on it (under-replication, drains, repair planning) ask
each content its own RF. On SQLite and PostgreSQL.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from sqlalchemy import literal, select

from pipeline.db.content_rf import RunRF, content_rf, run_rf
from pipeline.db.copies import short_contents, short_without
from pipeline.db.engine import session_scope
from pipeline.integrity.repair import plan
from tests.unit.test_content_gc import checkpoint, forget, sha, workers

#: Run /a keeps 1 copy on workers, /b 3; /c has no table of its own: the global 2.
RUNS = {"/a": {"rf": 1}, "/b": {"rf": 3}, "/c": {"keep_last": 4}}


@pytest.fixture
def per_run(db):
    return dataclasses.replace(db, rf=2, run_options=json.dumps(RUNS))


def rfs(s, settings, contents: list[int]) -> dict[int, int]:
    """Each content's RF, asked the three ways; they must agree."""
    by_run = run_rf(s, settings)
    batch = by_run.of(s, [sha(n) for n in contents])
    sql = {n: s.scalar(select(by_run.of_content(literal(sha(n))))) for n in contents}
    one = {n: content_rf(s, settings, sha(n)) for n in contents}
    assert {n: batch[sha(n)] for n in contents} == sql == one
    return one


def test_a_shared_content_takes_the_largest_rf_of_the_runs_that_reference_it(per_run):
    with session_scope(per_run.db_url) as s:
        workers(s)
        checkpoint(s, "a1", [1, 2], run="/a")
        checkpoint(s, "b1", [2, 3], run="/b")
        checkpoint(s, "c1", [3, 4, 5], run="/c")
        checkpoint(s, "a2", [5], run="/a")
        assert rfs(s, per_run, [1, 2, 3, 4, 5, 6]) == {
            1: 1,  # /a alone
            2: 3,  # /a and /b
            3: 3,  # /b and /c
            4: 2,  # /c: the global RF
            5: 2,  # /a (1) and /c (2)
            6: 2,  # referenced by nothing: the global RF
        }


def test_a_forgotten_checkpoints_run_no_longer_counts(per_run):
    with session_scope(per_run.db_url) as s:
        workers(s)
        checkpoint(s, "a1", [1, 2], run="/a")
        b1 = checkpoint(s, "b1", [2, 3], run="/b")
        assert rfs(s, per_run, [2, 3]) == {2: 3, 3: 3}
        forget(s, b1)
        s.flush()
        assert rfs(s, per_run, [2, 3]) == {2: 1, 3: 2}  # 3: no live reference left, the global RF


def test_without_a_run_of_its_own_rf_nothing_is_asked_per_run(db):
    with session_scope(db.db_url) as s:
        workers(s)
        checkpoint(s, "a1", [1], run="/a")
        assert run_rf(s, db) == RunRF(db.rf)
        assert rfs(s, db, [1, 2]) == {1: db.rf, 2: db.rf}


def test_the_under_replication_sweep_asks_each_content_the_rf_of_its_runs(per_run):
    with session_scope(per_run.db_url) as s:
        workers(s)
        checkpoint(s, "a1", [1], run="/a", copies=("w0",))  # RF 1: one copy is enough
        checkpoint(s, "b1", [2], run="/b", copies=("w0", "w1"))  # RF 3: short by one
        checkpoint(s, "c1", [3], run="/c", copies=("w0", "w1"))  # the global 2: fine
        checkpoint(s, "c2", [4], run="/c", copies=("w0",))  # short
        assert sorted(short_contents(s, run_rf(s, per_run))) == [sha(2), sha(4)]
        assert sorted(short_contents(s, RunRF(2))) == [sha(1), sha(4)]  # one global RF: not the same answer


def test_a_drain_moves_each_content_to_its_own_rf(per_run):
    with session_scope(per_run.db_url) as s:
        workers(s, 4)
        checkpoint(s, "a1", [1], run="/a", copies=("w0", "w1"))  # 1 elsewhere: enough for /a
        checkpoint(s, "b1", [2, 4], run="/b", copies=("w0", "w1", "w2"))  # 2 elsewhere: short of /b's 3
        checkpoint(s, "c1", [3], run="/c", copies=("w0", "w1", "w2"))  # 2 elsewhere: the global 2
        held, short, size = short_without(s, "w0", run_rf(s, per_run))
        assert (held, short, size) == (4, 2, 2000)  # 2 and 4
        assert short_without(s, "w0", 2)[1] == 1 and short_without(s, "w0", 3)[1] == 4  # one RF for all: 1; all


def test_repair_plans_the_copies_the_contents_rf_still_needs(per_run):
    with session_scope(per_run.db_url) as s:
        workers(s, 4)
        checkpoint(s, "a1", [1, 2], run="/a", copies=("w0",))
        checkpoint(s, "b1", [2], run="/b", copies=("w0",))
        assert plan(s, per_run, sha(1)) is None  # /a's RF 1 is met
        w = plan(s, per_run, sha(2))
        assert w is not None and w.need == 2  # shared with /b: its RF 3


def test_ckpt_policy_shows_each_runs_placement(db, capsys, monkeypatch):
    from pipeline.cli.main import main

    db.home.mkdir(parents=True, exist_ok=True)
    (db.home / "config.toml").write_text('[runs."/a"]\nrf = 1\n[runs."/b"]\nrf = 3\n')
    with session_scope(db.db_url) as s:
        workers(s)
        checkpoint(s, "a1", [1], run="/a")
        checkpoint(s, "c1", [2], run="/c")
    monkeypatch.setenv("CKPT_DATABASE_URL", db.db_url)
    assert main(["--home", str(db.home), "policy"]) == 0
    out = capsys.readouterr().out
    assert "/a: remote retention" in out and "  placement: RF 1 on storage workers\n" in out
    assert f"  placement: RF {db.rf} on storage workers\n" in out.split("/c: ")[1]
