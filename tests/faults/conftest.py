"""Fault-injection fixtures: one failpoint cluster per module, and the session's fault table."""
from __future__ import annotations

import pytest

from tests.conftest import fault_table_path
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


def pytest_sessionfinish(session, exitstatus):
    """The rows are made in the process that ran the fault tests (an xdist worker): saved
    there; tests/conftest.py prints them at the end of the run."""
    if Table.rows:
        out = fault_table_path(session.config)
        out.parent.mkdir(parents=True, exist_ok=True)
        Table.save(out)
