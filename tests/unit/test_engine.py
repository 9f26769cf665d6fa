"""SQLite transactions wait for the write lock in short steps, and give up at the timeout; the
threads of one process take turns first (pipeline/db/turns.py).

How much sooner than SQLite's own busy handler they get it is measured by ``bench``
(transition p99), not here."""
from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from pipeline.db.engine import BUSY_TIMEOUT_MS, begin_immediate


def connect(path):
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


def test_begin_waits_for_the_writer_and_then_takes_the_lock(tmp_path):
    db = str(tmp_path / "x.db")
    holder, waiter = connect(db), connect(db)
    holder.execute("BEGIN IMMEDIATE")
    released = []

    def release() -> None:
        time.sleep(0.3)
        released.append(time.monotonic())
        holder.execute("COMMIT")

    threading.Thread(target=release).start()
    begin_immediate(waiter)
    got = time.monotonic()
    waiter.execute("COMMIT")
    assert released and got >= released[0], "took the lock while another connection held it"
    assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS


def test_begin_gives_up_at_its_timeout(tmp_path):
    db = str(tmp_path / "x.db")
    holder, waiter = connect(db), connect(db)
    holder.execute("BEGIN IMMEDIATE")
    t = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        begin_immediate(waiter, timeout=0.2)
    assert 0.2 <= time.monotonic() - t < 1.0
    holder.execute("ROLLBACK")
    assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS


def test_a_thread_waits_for_its_turn_without_asking_sqlite_while_another_thread_writes(tmp_path, monkeypatch):
    """pipeline/db/turns.py: a writer of this process waits on the turn (asleep), not by asking
    SQLite for its lock again and again, while another thread of this process writes."""
    from sqlalchemy import text

    from pipeline.db import engine as engine_mod

    url = f"sqlite:///{tmp_path / 'x.db'}"
    asked = []
    real = engine_mod.begin_immediate
    monkeypatch.setattr(engine_mod, "begin_immediate", lambda conn, *a, **k: (asked.append(time.monotonic()),
                                                                              real(conn, *a, **k))[1])
    with engine_mod.session_scope(url) as s:
        s.execute(text("CREATE TABLE t (x INTEGER)"))
    asked.clear()
    done: list[float] = []

    def second() -> None:
        with engine_mod.session_scope(url) as s2:
            s2.execute(text("INSERT INTO t VALUES (2)"))
        done.append(time.monotonic())

    with engine_mod.session_scope(url) as s:
        s.execute(text("INSERT INTO t VALUES (1)"))
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)
        assert len(asked) == 1 and not done  # only this transaction asked SQLite; the other sleeps
        committed = time.monotonic()
    waiter.join(10)
    assert len(asked) == 2 and done and done[0] >= committed
    with engine_mod.session_scope(url) as s:
        assert sorted(s.scalars(text("SELECT x FROM t"))) == [1, 2]
    engine_mod.dispose_all()


def test_a_turn_whose_transaction_ended_without_its_event_is_taken_over(tmp_path):
    """A holder's connection closed under it (no commit or rollback event): the next writer
    finds it out of its transaction and takes the turn."""
    from pipeline.db.turns import WriteTurn

    db = str(tmp_path / "x.db")
    holder, waiter = connect(db), connect(db)
    turn = WriteTurn()
    turn.take(holder, 1)
    holder.execute("BEGIN IMMEDIATE")
    turn.began(holder)
    t = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        turn.take(waiter, 0.2)  # still writing: the waiter times out
    assert time.monotonic() - t >= 0.2
    holder.close()  # its transaction ends, and nobody says so
    turn.take(waiter, 1)
    turn.give(waiter)
