"""The writers of one process take turns for SQLite's write lock (docs/design.md, section 1).

SQLite has one writer at a time, and :func:`pipeline.db.engine.begin_immediate` asks for the
lock again every 0.1-2 ms while another connection holds it. Between processes that is what
keeps the wait short; between the threads of one process (a Dramatiq worker's 4-8 threads) it
is wasted work: every waiting thread asks again and again while a thread beside it holds the
lock (how much CPU that was is not known: docs/benchmarks.md, "Issue 31: one thread"). So a
thread first takes this process's turn for the database, sleeping on a lock (no CPU) while
another thread of the process writes, and only then asks SQLite, which it now waits for only
while another process writes.

A turn is given back when its transaction commits or rolls back (the engine's events). A turn
whose transaction ended without either (its connection closed or invalidated under it) is
taken over by the next writer: the holder's connection is no longer in a transaction.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

#: How often a waiting writer looks whether the turn's holder still writes (seconds).
LOOK_EVERY = 0.05


class TurnTimeout(sqlite3.OperationalError):
    """Raised when a writer waited its whole timeout for a turn another thread of this process
    held ("database is locked", as SQLite says of a lock held too long)."""


class WriteTurn:
    """Whose turn it is to write to one SQLite database, among the threads of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._guard = threading.Lock()
        self._holder: Any = None  # the DBAPI connection holding the turn
        self._began = False  # its BEGIN IMMEDIATE returned: from then on it is in a transaction

    def take(self, dbapi_conn: Any, timeout: float) -> None:
        """Wait for the turn (at most ``timeout`` seconds), for ``dbapi_conn``."""
        deadline = time.monotonic() + timeout
        while not self._lock.acquire(timeout=max(0.0, min(LOOK_EVERY, deadline - time.monotonic()))):
            self._take_over_ended()
            if time.monotonic() >= deadline:
                raise TurnTimeout(f"database is locked (another thread of this process wrote for {timeout:.0f} s)")
        with self._guard:
            self._holder, self._began = dbapi_conn, False

    def began(self, dbapi_conn: Any) -> None:
        """``dbapi_conn``'s transaction began: it holds SQLite's write lock until it ends."""
        with self._guard:
            if self._holder is dbapi_conn:
                self._began = True

    def give(self, dbapi_conn: Any) -> None:
        """``dbapi_conn``'s transaction ends (or never began): the next writer's turn."""
        with self._guard:
            if self._holder is dbapi_conn and dbapi_conn is not None:
                self._holder, self._began = None, False
                self._lock.release()

    def _take_over_ended(self) -> None:
        with self._guard:
            holder = self._holder
            if holder is not None and self._began and not _in_transaction(holder):
                self._holder, self._began = None, False
                self._lock.release()


def _in_transaction(dbapi_conn: Any) -> bool:
    try:
        return bool(dbapi_conn.in_transaction)
    except sqlite3.ProgrammingError:  # closed
        return False
