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


@pytest.fixture(scope="module")
def process_broker(redis_server, tmp_path_factory):
    """The process-wide Dramatiq broker is installed by the first import of pipeline.tasks,
    from the settings of that moment. The machine only calls the actors' functions (its
    messages never reach a broker), but the web tests that may run in this process later need
    the shared embedded Redis: if nothing imported pipeline.tasks yet, it is imported here
    with settings that name that Redis."""
    import sys

    if "pipeline.tasks" not in sys.modules:
        from pipeline import settings as settings_mod

        home = tmp_path_factory.mktemp("broker-home")
        settings_mod.configure(settings_mod.load({"home": home, "redis_url": f"unix://{redis_server.socket_file}"},
                                                 environ={}))
        import pipeline.tasks  # noqa: F401


@pytest.fixture
def model_soak(request) -> float:
    """Minutes the lifecycle machine runs for (``--model-soak``); 0: the bounded default."""
    return float(request.config.getoption("--model-soak"))
