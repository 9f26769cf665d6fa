"""Chaos soak fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture
def chaos_minutes(request) -> float:
    """Minutes the chaos soak runs (``--chaos-minutes``); 0: the suite's 3 minutes."""
    return float(request.config.getoption("--chaos-minutes"))
