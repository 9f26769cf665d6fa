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


# -- restore confinement (issue 27: "--overwrite never removes ... a run, nor a root") --------

def test_restore_overwrite_never_replaces_a_run(world):
    """Found by the machine (shrunk): a protected checkpoint restored with --overwrite to its
    own run directory. Broke (d): the restore renamed the run aside and put the checkpoint's
    files in its place, so the run (every other checkpoint in it) was gone."""
    s = world.save("r0", "st_step")
    steps(world, world.settle)
    world.restore(s, "run", overwrite=True)  # refused, or a Violation
    world.check()


def test_restore_in_place_never_overwrites_a_save_being_written(world):
    """Found by the machine (shrunk from 33 steps): ``trainer.save_model()`` writes
    model.safetensors, it is protected; the trainer starts writing it again (half of the new
    file is there); ``ckpt restore PATH --to PATH --overwrite`` puts the old version over the
    new one. Broke (a): the half-written new save was overwritten by the system, and nothing
    anywhere holds its bytes (the restore checked that the path's recorded version is
    protected, not what is on disk now)."""
    s = world.save("r0", "st_final")
    steps(world, world.settle)
    steps(world, lambda: world.resave(s, slow=True))
    world.restore(s, "in_place", overwrite=True)  # refused, or (a) below
    world.check()
