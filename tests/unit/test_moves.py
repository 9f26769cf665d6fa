"""Copies and storage workers move the way jobs do: along one declared table each, through one mover.

The package's source is read (as ``test_layout`` reads it): no code but the movers writes a copy's
or a worker's state, in any of the idioms that used to do it (an ORM attribute, a Core
``update(...).values(state=...)``, a constructor, raw SQL). The movers refuse moves their table
lacks and write the columns each target implies; a property test drives random sequences of
moves (with clocks that jump) against a model of the table and checks, after every move, that a
copy counts as re-hashed only after it was stored.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from pipeline import states
from pipeline.db import workers
from pipeline.db.copies import move, new_copy, on
from pipeline.db.engine import session_scope
from pipeline.db.models import Content, ContentCopy, StorageWorker
from pipeline.errors import InvalidMove
from pipeline.states import COPY_MOVES, WORKER_MOVES, CopyState, WorkerState, copy_sources

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "webui").rglob("*.py"))
#: The movers: the only functions that may write a copy's or a worker's state, or create one.
MOVERS = {("pipeline/db/copies.py", "move"), ("pipeline/db/copies.py", "new_copy"),
          ("pipeline/db/workers.py", "set_state"), ("pipeline/db/workers.py", "add")}
#: ``.state =`` on other rows: a content's lifecycle (``live -> condemned -> deleted``, under the
#: row-lock protocol of garbage collection), named by the variable that holds it.
CONTENT_WRITES = {("pipeline/integrity/gc.py", "content"), ("pipeline/store/sharding.py", "c")}
MODELS = {"ContentCopy", "StorageWorker"}
RAW_SQL = re.compile(r"\b(update\s+(copies|storage_workers)\b.*\bset\b.*\bstate\b|insert\s+into\s+(copies|"
                     r"storage_workers)\b)", re.IGNORECASE | re.DOTALL)


def _root_call(node: ast.expr) -> ast.Call | None:
    """The innermost call of a chain like ``update(X).where(...).values(...)``: ``update(X)``."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return node if isinstance(node, ast.Call) else None


def _sets_state(call: ast.Call) -> bool:
    """Whether a ``values(...)``-like call may set ``state``: by keyword, by ``**``, or a dict with it."""
    if any(k.arg in ("state", None) for k in call.keywords):
        return True
    return any(isinstance(a, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "state" or k is None
                                                for k in a.keys) for a in call.args)


def state_writes(source: str, rel: str) -> list[str]:
    """Every write of a copy's or a worker's state in ``source`` outside the movers, as ``line: what``."""
    tree = ast.parse(source)
    out: list[str] = []
    owner: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                owner.setdefault(node, fn.name)

    def allowed(node: ast.AST) -> bool:
        return (rel, owner.get(node, "")) in MOVERS

    for node in ast.walk(tree):
        if allowed(node):
            continue
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if isinstance(t, ast.Attribute) and t.attr == "state":
                    holder = ast.unparse(t.value)
                    if (rel, holder) not in CONTENT_WRITES:
                        out.append(f"{node.lineno}: {holder}.state = ...")
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name in MODELS:
                out.append(f"{node.lineno}: {name}(...) creates a row")
            elif name == "setattr" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value == "state":
                out.append(f"{node.lineno}: setattr(..., 'state', ...)")
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "values" and _sets_state(node):
                root = _root_call(node.func.value)
                if root is not None and isinstance(root.func, ast.Name) and root.func.id in ("update", "insert") \
                        and root.args and isinstance(root.args[0], ast.Name) and root.args[0].id in MODELS:
                    out.append(f"{node.lineno}: {root.func.id}({root.args[0].id}).values(state=...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and RAW_SQL.search(node.value):
            out.append(f"{node.lineno}: raw SQL writes copies or workers")
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_but_the_movers_writes_a_copys_or_a_workers_state(path: Path):
    rel = str(path.relative_to(ROOT))
    bad = state_writes(path.read_text(), rel)
    assert not bad, f"{rel} changes a copy's or a worker's state outside pipeline.db.copies.move / " \
                    f"pipeline.db.workers.set_state: {bad}"


@pytest.mark.parametrize("snippet", [
    "cp.state = CopyState.ABANDONED",
    "cp.state, cp.last_error = CopyState.ABANDONED, why",
    "w.state, w.last_error = WorkerState.REMOVABLE, None",
    "s.execute(update(ContentCopy).where(ContentCopy.id == 1).values(state=CopyState.STORED))",
    "s.execute(update(StorageWorker).where(StorageWorker.id == 'w').values(state='down'))",
    "s.execute(update(ContentCopy).where(ContentCopy.id == 1).values(stored_at=t, **done))",
    "s.execute(update(ContentCopy).values({'state': 'verified'}))",
    "s.add(ContentCopy(sha256=sha, worker_id=w, state=CopyState.PENDING))",
    "s.add(StorageWorker(id=i, url=u, source='static'))",
    "setattr(cp, 'state', 'verified')",
    "s.execute(text('UPDATE copies SET state = :s WHERE id = :i'))",
])
def test_the_scan_finds_each_idiom_that_used_to_write_state(snippet: str):
    assert state_writes(f"def step():\n    {snippet}\n", "pipeline/store/x.py")


def test_the_scan_lets_the_movers_content_and_other_columns_be():
    code = ("def step():\n    content.state = ContentState.DELETED\n"
            "    s.execute(update(ContentCopy).values(attempts=0))\n    cp.attempts += 1\n"
            "    s.execute(update(Job).values(state='done'))\n")
    assert state_writes(code, "pipeline/integrity/gc.py") == []
    assert state_writes("def move():\n    s.execute(update(ContentCopy).values(state=to))\n",
                        "pipeline/db/copies.py") == []


# --- the tables ---------------------------------------------------------------------------------

def test_every_state_has_a_row_in_its_table():
    assert set(COPY_MOVES) == set(CopyState)
    assert set(WORKER_MOVES) == set(WorkerState)


def test_a_copy_is_verified_only_from_a_held_state_and_nothing_enters_trimmed():
    assert copy_sources(CopyState.VERIFIED) == states.HELD
    assert copy_sources(CopyState.TRIMMED) == frozenset()
    assert copy_sources(CopyState.DELETING) == set(CopyState)  # a condemned content's copies all go


def test_the_sticky_rule_is_in_the_table():
    """A probe (up, full, down, rejected) never moves a worker out of an operator's decision."""
    for sticky in states.STICKY_WORKERS:
        assert not WORKER_MOVES[WorkerState(sticky)] & {WorkerState.UP, WorkerState.FULL, WorkerState.DOWN,
                                                          WorkerState.REJECTED}
    assert states.WORKER_INITIAL == WorkerState.CANDIDATE


# --- the copy mover ----------------------------------------------------------------------------

T0 = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
SHA = "cd" * 32
WORKERS = ("w1", "w2", "w3")


def _fresh(s) -> list[ContentCopy]:
    """One content with a pending copy on each of three up workers (rows made by the movers)."""
    for table in (ContentCopy, Content, StorageWorker):
        s.execute(delete(table))
    content = Content(sha256=SHA, size=1, created_at=T0, last_referenced_at=T0)
    s.add(content)
    for w in WORKERS:
        workers.add(s, w, f"http://127.0.0.1:1/{w}", source="static")
    rows = [new_copy(content, w) for w in WORKERS]
    s.flush()
    return rows


def test_stored_then_verified_writes_the_timestamps_each_implies(db):
    with session_scope(db.db_url) as s:
        cp = _fresh(s)[0]
        assert move(s, cp, CopyState.STORED, at=T0) == 1
        assert (cp.state, cp.stored_at, cp.checked_at, cp.verified_at) == ("stored", T0, T0, None)
        later = T0 + timedelta(seconds=5)
        assert move(s, cp, CopyState.VERIFIED, at=later + timedelta(seconds=1), rehashed_at=later) == 1
        assert (cp.state, cp.stored_at, cp.verified_at, cp.checked_at) == (
            "verified", T0, later, later + timedelta(seconds=1))


def test_a_rehash_older_than_the_store_verifies_nothing(db):
    with session_scope(db.db_url) as s:
        cp = _fresh(s)[0]
        move(s, cp, CopyState.STORED, at=T0)
        assert move(s, cp, CopyState.VERIFIED, at=T0, rehashed_at=T0 - timedelta(microseconds=1)) == 0
        assert cp.state == CopyState.STORED and cp.verified_at is None


def test_refused_moves_raise(db):
    with session_scope(db.db_url) as s:
        cp = _fresh(s)[0]
        with pytest.raises(InvalidMove, match="'pending' to 'verified'"):
            move(s, cp, CopyState.VERIFIED, at=T0)  # never re-hashed after a store
        with pytest.raises(InvalidMove):
            move(s, on("w1", SHA), CopyState.STORED, from_=(CopyState.VERIFIED,))
        with pytest.raises(InvalidMove):
            move(s, on("w1", SHA), CopyState.TRIMMED)
        move(s, cp, CopyState.DELETING)
        with pytest.raises(InvalidMove, match="'deleting' to 'pending'"):
            move(s, cp, CopyState.PENDING)  # only the deletion removes a deleting row
        assert cp.state == CopyState.DELETING


def test_a_condition_moves_only_the_rows_the_table_lets_move(db):
    with session_scope(db.db_url) as s:
        a, b, c = _fresh(s)
        move(s, a, CopyState.STORED, at=T0)
        move(s, b, CopyState.ABANDONED, error="unreachable")
        assert move(s, ContentCopy.sha256 == SHA, CopyState.VERIFIED, at=T0) == 1
        assert [r.state for r in (a, b, c)] == ["verified", "abandoned", "pending"]
        assert b.last_error == "unreachable"


def test_pending_again_is_a_new_copy_from_a_retired_row_and_a_resend_from_a_sent_one(db):
    with session_scope(db.db_url) as s:
        a, b, _ = _fresh(s)
        for cp in (a, b):
            cp.attempts = 3
            move(s, cp, CopyState.STORED, at=T0)
            move(s, cp, CopyState.VERIFIED, at=T0)
        move(s, a, CopyState.ABANDONED, error="worker unreachable")
        later = T0 + timedelta(minutes=1)
        move(s, a, CopyState.PENDING, at=later)
        assert (a.attempts, a.stored_at, a.verified_at, a.checked_at, a.last_error) == (0, None, None, T0, None)
        move(s, b, CopyState.PENDING, at=later, error="missing on the worker at verify")
        assert (b.attempts, b.stored_at, b.verified_at, b.checked_at, b.last_error) == (
            3, None, None, later, "missing on the worker at verify")


# --- the worker mover --------------------------------------------------------------------------

def test_a_worker_moves_only_along_its_table(db):
    with session_scope(db.db_url) as s:
        s.execute(delete(ContentCopy))
        s.execute(delete(StorageWorker))
        w = workers.add(s, "w9", "http://127.0.0.1:1/w9", source="static")
        assert w.state == WorkerState.CANDIDATE
        assert workers.set_state(s, w, WorkerState.UP, error=None)
        assert not workers.set_state(s, w, WorkerState.UP)  # a repeat is no move
        assert workers.set_state(s, w, WorkerState.DRAINING)
        with pytest.raises(InvalidMove, match="'draining' to 'up'"):
            workers.set_state(s, w, WorkerState.UP)
        assert not workers.observe(s, w, WorkerState.DOWN, error="connection refused")  # sticky
        assert (w.state, w.last_error) == ("draining", "connection refused")
        assert workers.set_state(s, w, WorkerState.REMOVABLE, error=None)
        assert not workers.observe(s, w, WorkerState.REJECTED, error="a stranger answers")  # sticky too
        assert (w.state, w.last_error) == ("removable", "a stranger answers")
        assert s.scalar(select(StorageWorker.state).where(StorageWorker.id == "w9")) == "removable"


# --- the property: random histories of moves ---------------------------------------------------

@dataclass
class Row:
    """The model of one copy: what the table and the implied columns say it must be."""

    state: str
    stored_at: datetime | None = None
    verified_at: datetime | None = None


def _model_move(row: Row, to: str, sources: frozenset[str], at: datetime, rehashed: datetime) -> bool:
    if row.state not in sources:
        return False
    if to == CopyState.VERIFIED and (row.stored_at is None or row.stored_at > rehashed):
        return False
    if to == CopyState.PENDING:
        row.stored_at = row.verified_at = None
    elif to == CopyState.STORED:
        row.stored_at, row.verified_at = at, None
    elif to == CopyState.VERIFIED:
        row.verified_at = rehashed
    row.state = to
    return True


#: Targets in the order the generator prefers (it favours the first): the ones that make a history
#: long (stored, verified, damaged and back) before the ones that end it (deleting).
PROGRESS = (CopyState.STORED, CopyState.VERIFIED, CopyState.CORRUPT, CopyState.MISSING, CopyState.PENDING,
            CopyState.ABANDONED, CopyState.DELETING)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_histories_of_moves_keep_verified_after_stored(db, data):
    """Given three copies, When random moves (mostly ones the table allows from where the chosen
    copies are, some it refuses; clocks that jump back) are made by condition, Then each copy is
    where the table and the model say, every change of state is an edge of COPY_MOVES, and after
    every move: a verified copy has ``stored_at <= verified_at``, a stored one no ``verified_at``,
    a pending one neither, and a checked state a ``checked_at``."""
    with session_scope(db.db_url) as s:
        rows = _fresh(s)
        model = {r.worker_id: Row(CopyState.PENDING) for r in rows}
        for _ in range(data.draw(st.integers(5, 40), label="moves")):
            chosen = data.draw(st.sets(st.sampled_from(WORKERS), min_size=1))
            reachable = [t for t in PROGRESS if any(t in COPY_MOVES[CopyState(model[w].state)] for w in chosen)]
            to = data.draw(st.sampled_from(reachable) if reachable and data.draw(st.integers(0, 4)) else
                           st.sampled_from([c for c in CopyState if copy_sources(c)]))
            at = T0 + timedelta(minutes=data.draw(st.integers(-5, 30)))  # clocks jump back too
            rehashed = at + timedelta(minutes=data.draw(st.integers(-5, 5)))
            narrow, one_source = data.draw(st.integers(0, 4)) == 0, data.draw(st.sampled_from(list(CopyState)))
            sources = copy_sources(to)
            from_ = None
            if narrow:
                if one_source not in sources:
                    with pytest.raises(InvalidMove):
                        move(s, on("w1", SHA), to, at=at, from_=(one_source,))
                    continue
                sources, from_ = frozenset({one_source}), (one_source,)
            before = {w: m.state for w, m in model.items()}
            expected = sum(_model_move(model[w], to, sources, at, rehashed) for w in sorted(chosen))
            where = ContentCopy.worker_id.in_(sorted(chosen)) & (ContentCopy.sha256 == SHA)
            assert move(s, where, to, at=at, from_=from_, rehashed_at=rehashed) == expected
            for cp in s.scalars(select(ContentCopy).where(ContentCopy.sha256 == SHA)):
                m = model[cp.worker_id]
                assert (cp.state, cp.stored_at, cp.verified_at) == (m.state, m.stored_at, m.verified_at)
                if cp.state != before[cp.worker_id]:
                    assert CopyState(cp.state) in COPY_MOVES[CopyState(before[cp.worker_id])]
                if cp.verified_at is not None:
                    assert cp.stored_at is not None and cp.stored_at <= cp.verified_at
                if cp.state == CopyState.VERIFIED:
                    assert cp.verified_at is not None
                if cp.state == CopyState.STORED:
                    assert cp.stored_at is not None and cp.verified_at is None
                if cp.state == CopyState.PENDING:
                    assert cp.stored_at is None and cp.verified_at is None
                if cp.state in (CopyState.STORED, CopyState.VERIFIED, CopyState.CORRUPT, CopyState.MISSING):
                    assert cp.checked_at is not None
