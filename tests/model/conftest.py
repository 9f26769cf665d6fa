"""Fixtures of the model-based lifecycle test: three real storage worker processes, started
once per test module and shared by every example (each example has its own control plane,
root and tensors, so what earlier examples stored is never referenced again)."""
from __future__ import annotations

import pytest

from tests.processes import storage_workers


@pytest.fixture(scope="module")
def model_workers(tmp_path_factory, process_broker):
    with storage_workers(tmp_path_factory.mktemp("model-workers"), 3) as ws:
        yield ws


@pytest.fixture
def model_soak(request) -> float:
    """Minutes the lifecycle machine runs for (``--model-soak``); 0: the bounded default."""
    return float(request.config.getoption("--model-soak"))
