"""The reads every page and ``ckpt status`` make, written to read as few rows as they can at 100k
checkpoints (docs/benchmarks.md), held to a recount of plain rows on SQLite and PostgreSQL:
each run's unique and shared stored bytes (pipeline.capacity.per_run), the live contents no
worker holds a good copy of (pipeline.status.lost_contents), the bytes each worker holds and all
the bytes stored (summed from the copies' own sizes, migration 0020), the thinned capacity history.

Given a random catalog (runs, kept and released checkpoints, shards sharing contents within a
run and across runs, copies in every state on workers of every state), When the read is made,
Then it says what the rows say."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from alembic import command
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select, text

from pipeline import capacity, states
from pipeline.core.copies import good_workers
from pipeline.db.copies import content_copies, held_per_worker
from pipeline.db.engine import get_engine, session_scope
from pipeline.db.migrate import alembic_config
from pipeline.db.models import (
    CapacitySample,
    Checkpoint,
    CheckpointFile,
    Content,
    ContentCopy,
    Shard,
    StorageWorker,
)
from pipeline.states import ContentState, CopyState, WorkerState
from pipeline.status import lost_contents

NOW = datetime(2026, 11, 26, 8, 0, tzinfo=UTC)
RUNS = ("/r/a", "/r/b", "/r/c")
WORKERS = ("w1", "w2", "w3")
CONTENTS = 6

checkpoint = st.tuples(st.sampled_from(RUNS), st.booleans(),  # its run; released (superseded, forgotten...)
                       st.lists(st.lists(st.integers(0, CONTENTS - 1), min_size=1, max_size=3),  # files: shards
                                min_size=1, max_size=2))
copy = st.tuples(st.integers(0, CONTENTS - 1), st.sampled_from(WORKERS), st.sampled_from(list(CopyState)),
                 st.booleans())  # content, worker, state, verified after it was stored
catalogs = st.tuples(st.lists(checkpoint, max_size=7), st.lists(copy, max_size=14),
                     st.lists(st.sampled_from(list(ContentState)), min_size=CONTENTS, max_size=CONTENTS),
                     st.lists(st.sampled_from(list(WorkerState)), min_size=len(WORKERS), max_size=len(WORKERS)))


def sha(k: int) -> str:
    return f"{k:064x}"


def size(k: int) -> int:
    return 10 ** k  # each content's bytes distinct, so a sum says which contents it counted


def _fill(url: str, ckpts, copies, content_states, worker_states) -> dict[tuple[int, str], str]:
    """The catalog as rows; the copies kept, one per (content, worker): (content, worker) -> state."""
    kept: dict[tuple[int, str], str] = {}
    with session_scope(url) as s:
        for table in (ContentCopy, Shard, CheckpointFile, Checkpoint, Content, StorageWorker):
            s.execute(delete(table))
        for k, state in enumerate(content_states):
            s.add(Content(sha256=sha(k), size=size(k), state=state, created_at=NOW, last_referenced_at=NOW))
        for wid, state in zip(WORKERS, worker_states, strict=True):
            s.add(StorageWorker(id=wid, url=f"http://127.0.0.1:1/{wid}", source="static", state=state))
        for i, (run, released, files) in enumerate(ckpts):
            ck = Checkpoint(path=f"{run}/c{i}", run=run, name=f"c{i}", is_dir=True, version=f"{i}", mtime=i,
                            total_bytes=1, released_at=NOW if released else None)
            s.add(ck)
            s.flush()
            for j, shards in enumerate(files):
                f = CheckpointFile(checkpoint_id=ck.id, relpath=f"f{j}", size=1, sha256="0" * 64, format="opaque",
                                   mtime_ns=0)
                s.add(f)
                s.flush()
                for seq, k in enumerate(shards):
                    s.add(Shard(file_id=f.id, seq=seq, kind="raw", sha256=sha(k), size=size(k), src_offset=0,
                                length=1))
        for k, wid, state, after in copies:
            if (k, wid) in kept:
                continue
            kept[(k, wid)] = state
            stored = NOW - timedelta(hours=2)
            s.add(ContentCopy(sha256=sha(k), worker_id=wid, state=state, stored_at=stored,
                              verified_at=stored + timedelta(hours=1 if after else -1)))
    return kept


#: Two runs share content 1 (both shared, and a third run's released checkpoint does not count);
#: content 2 is b's alone.
TWO_RUNS = ([("/r/a", False, [[1]]), ("/r/b", False, [[1, 2], [2]]), ("/r/c", True, [[1]])],
            [(1, "w1", "verified", True), (1, "w2", "stored", True), (2, "w1", "verified", True)],
            [ContentState.LIVE] * CONTENTS, [WorkerState.UP] * len(WORKERS))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(catalogs)
@example(TWO_RUNS)
def test_each_runs_unique_and_shared_bytes_are_what_the_rows_say(db, catalog):
    """Per run, the contents its kept checkpoints reference (each once, however many shards
    name it), size x sent copies (stored or verified, on any worker): unique when no other
    run's kept checkpoint references the content, else shared; a run asked alone is as among
    every run."""
    ckpts, copies, content_states, worker_states = catalog
    kept = _fill(db.db_url, ckpts, copies, content_states, worker_states)
    refs: dict[str, set[int]] = {}
    for run, released, files in ckpts:
        if not released:
            refs.setdefault(run, set()).update(k for shards in files for k in shards)
    runs_of = {k: sum(1 for contents in refs.values() if k in contents) for k in range(CONTENTS)}
    sent = {k: sum(1 for (c, _w), state in kept.items() if c == k and state in states.SENT) for k in range(CONTENTS)}
    want = {run: {"unique": sum(size(k) * sent[k] for k in contents if runs_of[k] == 1),
                  "shared": sum(size(k) * sent[k] for k in contents if runs_of[k] > 1)}
            for run, contents in refs.items()}
    with session_scope(db.db_url, readonly=True) as s:
        assert capacity.per_run(s) == want
        for run in RUNS:
            assert capacity.per_run(s, [run]) == ({run: want[run]} if run in want else {})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(catalogs)
def test_lost_contents_are_the_live_ones_without_a_good_copy(db, catalog):
    """A live content is lost when no worker holds a good copy of it (pipeline.core.copies, the
    Python form of the rule): the SQL read names exactly those."""
    ckpts, copies, content_states, worker_states = catalog
    _fill(db.db_url, ckpts, copies, content_states, worker_states)
    with session_scope(db.db_url, readonly=True) as s:
        rows = content_copies(s, [sha(k) for k in range(CONTENTS)])
        want = {sha(k) for k in range(CONTENTS)
                if content_states[k] == ContentState.LIVE and not good_workers(rows[sha(k)])}
        assert set(s.scalars(lost_contents())) == want


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(catalogs)
def test_the_bytes_each_worker_holds_and_all_stored_are_what_the_rows_say(db, catalog):
    """Per worker, its sent copies (stored, verified) and their contents' bytes; in all, the
    sent copies' bytes and those of condemned contents: the copies made without a size (as
    here) carry their content's all the same."""
    ckpts, copies, content_states, worker_states = catalog
    kept = _fill(db.db_url, ckpts, copies, content_states, worker_states)
    sent = [(k, w) for (k, w), state in kept.items() if state in states.SENT]
    want = {w: (sum(1 for _k, x in sent if x == w), sum(size(k) for k, x in sent if x == w))
            for w in {w for _k, w in sent}}
    with session_scope(db.db_url, readonly=True) as s:
        assert held_per_worker(s) == want
        assert held_per_worker(s, ["w2"]) == ({"w2": want["w2"]} if "w2" in want else {})
        assert capacity.stored_bytes(s) == (
            sum(size(k) for k, _w in sent),
            sum(size(k) for k, _w in sent if content_states[k] == ContentState.CONDEMNED))


def test_0020_gives_each_existing_copy_its_contents_size(db):
    cfg = alembic_config(db.db_url)
    with get_engine(db.db_url).connect() as conn:
        cfg.attributes["connection"] = conn
        conn.execute(text("DELETE FROM copies"))
        conn.execute(text("DELETE FROM contents"))
        conn.commit()
        command.downgrade(cfg, "0019")
        conn.commit()
        conn.execute(text("INSERT INTO storage_workers (id, url, zone, source, tier, state, capacity_bytes, free_bytes,"
                          " used_bytes) VALUES ('w9', 'http://x', '', 'static', 'workers', 'up', 0, 0, 0)"))
        for k in (1, 2):
            conn.execute(text("INSERT INTO contents (sha256, size, state, created_at, last_referenced_at) VALUES"
                              " (:s, :n, 'live', '2026-11-26 00:00:00', '2026-11-26 00:00:00')"),
                         {"s": sha(k), "n": size(k)})
            conn.execute(text("INSERT INTO copies (sha256, worker_id, state, attempts)"
                              " VALUES (:s, 'w9', 'verified', 0)"), {"s": sha(k)})
        conn.commit()
        command.upgrade(cfg, "head")
        conn.commit()
    try:
        with session_scope(db.db_url, readonly=True) as s:
            assert dict(s.execute(select(ContentCopy.sha256, ContentCopy.size)).all()) == {sha(1): 10, sha(2): 100}
            assert held_per_worker(s) == {"w9": (2, 110)}
    finally:
        with get_engine(db.db_url).connect() as conn:  # the other tests start from an empty database
            for table in ("copies", "contents", "storage_workers"):
                conn.execute(text(f"DELETE FROM {table}"))
            conn.commit()


def test_the_capacity_history_is_every_nth_sample_oldest_first(db):
    """``history(limit)`` thins the samples in SQL to every ``len // limit``-th from the first,
    oldest first, as slicing every row would: samples with the same time stay in insertion order."""
    times = [NOW + timedelta(minutes=10 * i) for i in range(23)] + [NOW + timedelta(minutes=15)] * 3
    with session_scope(db.db_url) as s:
        s.execute(delete(CapacitySample))
        for i, at in enumerate(times):
            s.add(CapacitySample(at=at, used_bytes=i, capacity_bytes=100 + i, stored_bytes=200 + i))
    with session_scope(db.db_url, readonly=True) as s:
        rows = s.execute(select(CapacitySample.at, CapacitySample.used_bytes, CapacitySample.stored_bytes,
                                CapacitySample.capacity_bytes).order_by(CapacitySample.at, CapacitySample.id)).all()
        every = [{"at": at, "used": u, "stored": st_, "capacity": cap} for at, u, st_, cap in rows]
        for limit in (1, 4, 7, 26, 2000):
            assert capacity.history(s, limit=limit) == every[::max(1, len(every) // limit)]
        assert capacity.history(s, limit=4)[1]["used"] != 1  # thinned: not the first rows in a row
