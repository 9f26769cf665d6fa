"""Fault-injection fixtures: one failpoint cluster per module, and the session's fault table."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, Table


@pytest.fixture(scope="module")
def fault_cluster(tmp_path_factory):
    c = FaultCluster(tmp_path_factory.mktemp("faults"))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def trials(request) -> int:
    """Trials per fault: 1 in the suite, more with ``--soak N``."""
    return max(1, request.config.getoption("--soak"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not Table.rows:
        return
    terminalreporter.write_sep("=", "fault table")
    terminalreporter.write_line(Table.render())
    out = Path(os.environ.get("CKPT_FAULT_TABLE") or config.rootpath / ".pytest_cache" / "fault-table.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    Table.save(out)
    terminalreporter.write_line(f"(saved as {out})")
