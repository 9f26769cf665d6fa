"""The Alembic revisions, on SQLite and PostgreSQL: they round-trip and build what the models say."""
from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Index, MetaData, Table, inspect, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex

from pipeline.db.engine import get_engine
from pipeline.db.migrate import alembic_config
from pipeline.db.models import Base, PartialIndex


def insert_checkpoint(conn, i: int) -> None:
    """Checkpoint ``i`` at /r/c<i>, as an older schema holds it (columns every revision has)."""
    conn.execute(text(
        "INSERT INTO checkpoints (id, path, run, name, is_dir, version, step, mtime, total_bytes,"
        " local_present, detected_at, current) VALUES (:i, :p, '/r', 'x', false, 'v', NULL, 0, 1, true,"
        " '2026-11-21 00:00:00', true)"), {"i": i, "p": f"/r/c{i}"})


def insert_jobs(conn, jobs: list[tuple[int, str, int, str]]) -> None:
    """Jobs (id, kind, checkpoint id, state), as an older schema holds them."""
    for jid, kind, ckpt, state in jobs:
        conn.execute(text("INSERT INTO jobs (id, kind, checkpoint_id, state, attempts, params, bytes_done,"
                          " bytes_total, created_at, updated_at) VALUES (:i, :k, :c, :s, 0, '{}', 0, 0,"
                          " '2026-11-21 00:00:00', '2026-11-21 00:00:00')"),
                     {"i": jid, "k": kind, "c": ckpt, "s": state})


def test_migrations_round_trip_and_match_the_models(db):
    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "base")
        command.upgrade(cfg, "head")
        conn.commit()
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diffs == []


PARTIAL = ["ix_checkpoints_disk_changed", "uq_alerts_open_key", "uq_jobs_active_repair"]


def test_the_partial_indexes_the_revisions_built_are_the_models(db):
    """Alembic's comparison (above) does not look at an index's WHERE: the partial indexes in
    the database (built by the revisions) are the models' PartialIndexes, by name, and on SQLite
    (which keeps the text as written; PostgreSQL keeps its own form of it) with the same predicate."""
    with get_engine(db.db_url).connect() as conn:
        key = f"{conn.dialect.name}_where"
        inspector = inspect(conn)
        built = {ix["name"]: str(ix["dialect_options"][key]) for table in Base.metadata.tables
                 for ix in inspector.get_indexes(table) if key in ix.get("dialect_options", {})}
    declared = {ix.name: ix.where for table in Base.metadata.tables.values() for ix in table.indexes
                if isinstance(ix, PartialIndex)}
    assert sorted(built) == sorted(declared) == PARTIAL
    if conn.dialect.name == "sqlite":
        assert built == declared


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.dialect()], ids=lambda d: d.name)
def test_a_partial_index_declares_its_where_on_both_backends(dialect):
    """The models' DDL for a partial index is what ``Index(..., sqlite_where=w, postgresql_where=w)``
    gives on each backend (the revisions' form), though the models fill a backend's options in only
    when it reads them: a SQLite control plane never imports the PostgreSQL dialect
    (pipeline.db.models.PartialIndex)."""
    partial = [ix for table in Base.metadata.tables.values() for ix in table.indexes if isinstance(ix, PartialIndex)]
    assert sorted(ix.name for ix in partial) == PARTIAL
    for ix in partial:
        assert ix.table is not None
        twin = Table(ix.table.name, MetaData(), *(Column(c.name, c.type) for c in ix.columns))  # not the models'
        plain = Index(ix.name, *(twin.c[c.name] for c in ix.columns), unique=ix.unique, sqlite_where=text(ix.where),
                      postgresql_where=text(ix.where))
        ddl = str(CreateIndex(ix).compile(dialect=dialect))
        assert ddl == str(CreateIndex(plain).compile(dialect=dialect))
        assert ddl.endswith(f" WHERE {ix.where}"), ddl


def test_a_partial_index_copied_or_rendered_by_alembic_keeps_its_where_on_both_backends():
    """Given a PartialIndex no backend has read yet (as the models' are in a fresh process), When
    SQLAlchemy copies its table (``Table.to_metadata``) or Alembic's autogenerate renders it (both go
    through ``Index.dialect_kwargs``), Then the copy and the rendered ``op.create_index`` carry the
    WHERE on SQLite and PostgreSQL: without it the partial unique indexes would come out as full
    unique ones (one alert per key ever, one repair per content ever)."""
    from alembic.autogenerate import render_python_code
    from alembic.operations import ops
    from sqlalchemy import Integer, String

    ix = PartialIndex("uq_t_k", "k", unique=True, where="gone IS NULL")
    table = Table("t", MetaData(), Column("k", String(8)), Column("gone", Integer), ix)
    assert {k: str(v) for k, v in ix.dialect_kwargs.items()} == {"sqlite_where": "gone IS NULL",
                                                                  "postgresql_where": "gone IS NULL"}
    [copy] = table.to_metadata(MetaData()).indexes
    for dialect in (sqlite.dialect(), postgresql.dialect()):
        assert str(CreateIndex(copy).compile(dialect=dialect)).endswith(" WHERE gone IS NULL")
    code = render_python_code(ops.UpgradeOps([ops.CreateIndexOp.from_index(ix)]))
    assert "sqlite_where=sa.text('gone IS NULL')" in code and "postgresql_where=sa.text('gone IS NULL')" in code, code


def test_0003_marks_only_the_newest_version_of_each_path_current(db):
    """Existing databases: every older version of a path stops being current, data kept."""

    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002")
        conn.commit()
        for i, path in enumerate(["/r/a", "/r/a", "/r/b", "/r/a"], start=1):
            conn.execute(text(
                "INSERT INTO checkpoints (id, path, run, name, is_dir, version, step, mtime, total_bytes,"
                " local_present, detected_at) VALUES (:i, :p, '/r', 'x', false, :v, NULL, 0, 1, true,"
                " '2026-11-21 00:00:00')"), {"i": i, "p": path, "v": f"v{i}"})
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
        rows = dict(conn.execute(text("SELECT id, current FROM checkpoints ORDER BY id")).all())
        command.downgrade(cfg, "0002")  # the other tests start from an empty database at head
        conn.execute(text("DELETE FROM checkpoints"))
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
    assert {i: bool(c) for i, c in rows.items()} == {1: False, 2: False, 3: True, 4: True}


def test_0004_merges_replicas_into_one_copy_per_content_and_worker(db):
    """Existing databases: shards of two checkpoints with the same content had a replica each
    on the same worker; after the upgrade that content has one copy there (a damaged row
    wins, else the newest verification), superseded checkpoints are released, old repair
    jobs that were still running end. The downgrade gives every shard its replicas back."""

    cfg = alembic_config(db.db_url)
    a, b = "a" * 64, "b" * 64
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0003")
        conn.commit()
        for w in ("w1", "w2"):
            conn.execute(text("INSERT INTO storage_workers (id, url, zone, source, state, capacity_bytes, free_bytes)"
                              " VALUES (:w, 'http://x', '', 'static', 'up', 0, 0)"), {"w": w})
        for i in (1, 2):
            insert_checkpoint(conn, i)
            conn.execute(text("INSERT INTO checkpoint_files (id, checkpoint_id, relpath, size, sha256, format,"
                              " mtime_ns) VALUES (:i, :i, '', 2, :h, 'opaque', 0)"), {"i": i, "h": "0" * 64})
            for seq, sha in enumerate((a, b)):
                conn.execute(text("INSERT INTO shards (id, file_id, seq, kind, sha256, size, src_offset, length,"
                                  " payload_offset) VALUES (:id, :f, :q, 'raw', :h, 1, :q, 1, 0)"),
                             {"id": 10 * i + seq, "f": i, "q": seq, "h": sha})
        replicas = [  # (shard, worker, state, verified_at)
            (10, "w1", "verified", "2026-11-21 01:00:00"), (20, "w1", "verified", "2026-11-21 02:00:00"),
            (11, "w1", "verified", "2026-11-21 01:00:00"), (21, "w1", "corrupt", None),
            (10, "w2", "abandoned", None), (20, "w2", "stored", None),
        ]
        for shard, w, state, verified in replicas:
            conn.execute(text("INSERT INTO replicas (shard_id, worker_id, state, attempts, stored_at, verified_at)"
                              " VALUES (:s, :w, :st, 0, '2026-11-21 00:30:00', :v)"),
                         {"s": shard, "w": w, "st": state, "v": verified})
        jobs = [(1, "store", 1, "verified"), (2, "store", 2, "verified"), (3, "store", 2, "superseded"),
                (4, "repair", 1, "repairing")]
        insert_jobs(conn, jobs)
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
        contents = dict(conn.execute(text("SELECT sha256, state FROM contents")).all())
        copies = {(sha, w): (st, str(v)[:19] if v else None) for sha, w, st, v in conn.execute(
            text("SELECT sha256, worker_id, state, verified_at FROM copies"))}
        released = {i: r is not None for i, r in conn.execute(text("SELECT id, released_at FROM checkpoints"))}
        repair = conn.execute(text("SELECT state FROM jobs WHERE id = 4")).scalar()
        command.downgrade(cfg, "0003")
        conn.commit()
        back = sorted(conn.execute(text("SELECT shard_id, worker_id, state FROM replicas")).all())
        for table in ("replicas", "jobs", "shards", "checkpoint_files", "checkpoints", "storage_workers"):
            conn.execute(text(f"DELETE FROM {table}"))  # the other tests start from an empty database
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
    assert contents == {a: "live", b: "live"}
    assert copies == {(a, "w1"): ("verified", "2026-11-21 02:00:00"), (b, "w1"): ("corrupt", None),
                      (a, "w2"): ("stored", None)}
    assert released == {1: False, 2: True}
    assert repair == "failed"
    assert back == sorted([(10, "w1", "verified"), (20, "w1", "verified"), (11, "w1", "corrupt"),
                           (21, "w1", "corrupt"), (10, "w2", "stored"), (20, "w2", "stored")])


def test_0005_fills_each_checkpoints_state_from_its_newest_store_job(db):
    """Existing databases: a checkpoint shows the state of its newest store job (not an older
    one, not a repair job's); one without a store job shows none."""

    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0004")
        conn.commit()
        for i in (1, 2, 3):
            insert_checkpoint(conn, i)
        jobs = [(1, "store", 1, "failed"), (2, "store", 1, "verified"), (3, "repair", 1, "repairing"),
                (4, "store", 2, "replicated"), (5, "restore", 3, "done")]
        insert_jobs(conn, jobs)
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
        shown = dict(conn.execute(text("SELECT id, store_state FROM checkpoints")).all())
        for table in ("jobs", "checkpoints"):
            conn.execute(text(f"DELETE FROM {table}"))
        conn.commit()
    assert shown == {1: "verified", 2: "replicated", 3: None}


def test_0013_says_why_each_local_copy_went_from_the_evidence_its_jobs_left(db):
    """Existing databases: a local copy our rotation removed is "rotated", one the watcher found
    gone "deleted" (the last of the two wins: restored after its rotation, then deleted by the
    trainer), one without such history by its state; a present one says nothing."""

    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0012")
        conn.commit()
        for i in range(1, 8):
            insert_checkpoint(conn, i)
        conn.execute(text("UPDATE checkpoints SET local_present = :no WHERE id <> 7"), {"no": False})
        states = {1: "rotated", 2: "verified", 3: "rotated", 4: "vanished", 5: "superseded", 6: "forgotten",
                  7: "verified"}
        insert_jobs(conn, [(i, "store", i, st) for i, st in states.items()])
        for k, st in states.items():
            conn.execute(text("UPDATE checkpoints SET store_state = :s WHERE id = :i"), {"s": st, "i": k})
        events = [(1, "local copy removed; 2+ verified replicas remain"),
                  (2, "local copy vanished from /r/c2"),
                  (3, "local copy removed; 2+ verified replicas remain"), (3, "local copy vanished from /r/c3"),
                  (6, "local copy removed by the local policy; 2+ verified replicas remained (collected ...)")]
        for n, (job, detail) in enumerate(events, start=1):
            conn.execute(text("INSERT INTO job_events (id, job_id, at, from_state, to_state, detail) VALUES"
                              " (:n, :j, '2026-11-21 00:00:00', 'verified', 'verified', :d)"),
                         {"n": n, "j": job, "d": detail})
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
        gone = dict(conn.execute(text("SELECT id, local_gone FROM checkpoints")).all())
        for table in ("job_events", "jobs", "checkpoints"):
            conn.execute(text(f"DELETE FROM {table}"))
        conn.commit()
    assert gone == {1: "rotated", 2: "deleted", 3: "deleted", 4: "deleted", 5: "replaced", 6: "rotated", 7: None}


def test_0015_makes_the_open_disk_alerts_one_per_filesystem(db):
    """Existing databases: the open ``disk_full`` alerts of ``ckpt up``'s three workers on one disk
    become one, the oldest, naming them all; the others are resolved as merged into it; a worker
    that does not say its filesystem is a disk of its own; other alerts are left as they are."""
    import json

    from pipeline.alerts import key_of

    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0014")
        conn.commit()
        for w, fs in (("w-0", "boot:2049:7"), ("w-1", "boot:2049:7"), ("w-2", "boot:2049:7"), ("w-3", None)):
            conn.execute(text("INSERT INTO storage_workers (id, url, zone, source, state, capacity_bytes, free_bytes,"
                              " filesystem) VALUES (:i, :u, '', 'local', 'full', 1000, 50, :f)"),
                         {"i": w, "u": f"http://127.0.0.1/{w}", "f": fs})
        rows = [(1, "disk_full", "w-1", "00:01"), (2, "disk_full", "w-0", "00:02"), (3, "disk_full", "w-2", "00:03"),
                (4, "disk_full", "w-3", "00:04"), (5, "worker_down", "w-0", "00:05")]
        for i, alert, subject, at in rows:
            conn.execute(text("INSERT INTO alerts (id, key, alert, subject, severity, summary, link, since, fired_at,"
                              " last_seen) VALUES (:i, :k, :a, :s, 'warning', 'x', '/', :t, :t, :t)"),
                         {"i": i, "k": key_of(alert, subject), "a": alert, "s": subject, "t": f"2026-11-21 {at}:00"})
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
        got = {i: (key, subject, resolution, json.loads(ev) if isinstance(ev, str) else ev, cleared)
               for i, key, subject, resolution, ev, cleared in conn.execute(text(
                   "SELECT id, key, subject, resolution, evidence, cleared_at FROM alerts ORDER BY id"))}
        resolved = {i for (i,) in conn.execute(text("SELECT id FROM alerts WHERE resolved_at IS NOT NULL"))}
        for table in ("alerts", "storage_workers"):
            conn.execute(text(f"DELETE FROM {table}"))
        conn.commit()
    assert got[1] == (key_of("disk_full", "boot:2049:7"), "boot:2049:7", None, ["w-0", "w-1", "w-2"], None)
    assert got[2][2] == got[3][2] == "merged into alert 1: one alert per filesystem" and resolved == {2, 3}
    assert got[4] == (key_of("disk_full", "worker:w-3"), "worker:w-3", None, ["w-3"], None)
    assert got[5] == (key_of("worker_down", "w-0"), "w-0", None, None, None)


def test_the_heads_read_from_the_files_are_alembics():
    from alembic.script import ScriptDirectory

    from pipeline.db.migrate import heads_on_disk

    assert heads_on_disk() == set(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())


def test_a_database_at_head_is_checked_without_alembic(tmp_path):
    """Every command first brings the database to head; one already there costs a query,
    not an import of Alembic and of every revision."""
    import subprocess
    import sys

    from pipeline.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'ckpt.db'}"
    probe = (f"import sys; from pipeline.db.migrate import upgrade; upgrade({url!r}); "
             "print('alembic' in sys.modules)")
    upgrade(url)  # a new database: Alembic builds it
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    cfg = alembic_config(url)
    with get_engine(url).connect() as conn:  # one revision behind: Alembic runs again
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "-1")
        conn.commit()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
