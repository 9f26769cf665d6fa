"""Histories the model-based lifecycle test (test_lifecycle.py) found, shrunk, as explicit
sequences of World steps; each names the invariant it broke. The first is a baseline: the
plain life of a run keeps every invariant."""
from __future__ import annotations

import pytest

from tests.model.world import World


@pytest.fixture
def world(model_workers, tmp_path):
    w = World(tmp_path / "ex", model_workers)
    yield w
    w.close()


def steps(world: World, *actions) -> None:
    """Run each action, then check every invariant (as the state machine does)."""
    for act in actions:
        act()
        world.check()


def test_baseline_saves_protect_rotate_and_restore(world):
    saves = [world.save("r0", "st_step") for _ in range(3)]
    world.check()
    steps(world, world.settle, world.settle)
    assert not saves[0].path.exists(), world.history  # rotated: keep_last 2
    assert world.restore(saves[0], "fresh", overwrite=False) == "done", world.history
    assert world.restore(saves[2], "fresh", overwrite=False) == "done", world.history
    world.check()
