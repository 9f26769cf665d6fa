"""SQLite transactions wait for the write lock in short steps, and give up at the timeout.

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
