"""Engines and sessions, one engine per process.

SQLite gets WAL, a busy timeout, foreign keys and ``BEGIN IMMEDIATE`` for every
transaction (deferred read-then-write transactions deadlock into
"database is locked" under several processes). PostgreSQL URLs get a plain engine.
Engines are never carried across ``fork``: :func:`get_engine` keys its cache by pid.
"""
from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, CursorResult, Engine, Result, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from pipeline import failpoints
from pipeline.errors import MissingRow

T = TypeVar("T")

BUSY_TIMEOUT_MS = 30_000
#: Longest pause between two tries of BEGIN IMMEDIATE (seconds).
MAX_PAUSE = 0.002

_lock = threading.Lock()
_engines: dict[tuple[int, str, bool], Engine] = {}


def _sqlite_setup(engine: Engine, *, readonly: bool = False) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        # Let SQLAlchemy's BEGIN (below) own transactions instead of the driver.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        if readonly:  # a write through this engine is an error, not a lock taken
            cur.execute("PRAGMA query_only=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        dbapi_conn = conn.connection.dbapi_connection
        if readonly and dbapi_conn is not None:
            # A deferred transaction: in WAL mode it reads a snapshot and never takes the
            # write lock, so pages and /metrics never hold up the pipeline's writes.
            dbapi_conn.execute("BEGIN")
        else:
            begin_immediate(dbapi_conn)


def begin_immediate(dbapi_conn: Any, timeout: float = BUSY_TIMEOUT_MS / 1000) -> None:
    """``BEGIN IMMEDIATE``, retried every millisecond or so while another writer holds the lock.

    SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25... ms between tries and is
    not woken when the lock frees: with 4 writers, one transaction in a hundred slept
    through five of them and waited 35-60 ms for a lock held for well under 1 ms.
    """
    deadline = time.monotonic() + timeout
    pause = 0.0002
    dbapi_conn.execute("PRAGMA busy_timeout=0")
    try:
        while True:
            try:
                dbapi_conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause = min(2 * pause, MAX_PAUSE)
    finally:
        dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


def make_engine(url: str, *, readonly: bool = False) -> Engine:
    """Create an engine for ``url`` with the control plane's connection rules; a ``readonly``
    one never writes (SQLite: deferred transactions, query_only; PostgreSQL: READ ONLY)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(u.database)), exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})
        _sqlite_setup(engine, readonly=readonly)
        return engine
    engine = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)
    return engine.execution_options(postgresql_readonly=True) if readonly else engine


def get_engine(url: str, *, readonly: bool = False) -> Engine:
    """The engine of this process for ``url`` (its read-only twin with ``readonly``)."""
    key = (os.getpid(), url, readonly)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = make_engine(url, readonly=readonly)
        return engine


def dispose_all() -> None:
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def optimize(url: str) -> bool:
    """Bring SQLite's query-planner statistics up to date as the catalog grows; True if it
    ran. Not for PostgreSQL, whose autovacuum analyzes.

    ``PRAGMA optimize`` checks every table from SQLite 3.46 on (``0x10002``); before that it
    only looks at the tables the same connection queried, so a fresh connection would do
    nothing, and a plain ANALYZE does the same work. Either way ``analysis_limit`` bounds what
    each index costs to a sample (milliseconds at 100k checkpoints), as SQLite advises for a
    periodic optimize.
    """
    if make_url(url).get_backend_name() != "sqlite":
        return False
    with get_engine(url).connect() as conn:
        conn.exec_driver_sql("PRAGMA analysis_limit=1000")
        conn.exec_driver_sql("PRAGMA optimize=0x10002" if sqlite3.sqlite_version_info >= (3, 46) else "ANALYZE")
        conn.commit()
    return True


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (what a compare-and-set reads to know it won)."""
    return result.rowcount if isinstance(result, CursorResult) else 0


def one(session: Session, model: type[T], key: object) -> T:
    """The row of ``model`` with primary key ``key``; :class:`MissingRow` if there is none."""
    row = session.get(model, key)
    if row is None:
        raise MissingRow(getattr(model, "__tablename__", model.__name__), key)
    return row


@contextmanager
def session_scope(url: str, *, readonly: bool = False) -> Iterator[Session]:
    """One short transaction: commit on success, roll back on error.

    Entry points own transactions; library functions take a ``session`` and never commit.
    ``readonly`` sessions (pages, status, metrics) never take the write lock and cannot write.
    """
    factory = sessionmaker(get_engine(url, readonly=readonly), expire_on_commit=False)
    session = factory()
    try:
        with session.begin():
            yield session
            failpoints.commit_point("before")
        failpoints.commit_point("after")
    finally:
        session.close()
