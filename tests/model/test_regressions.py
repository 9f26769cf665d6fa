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


# -- every layout protected or named; "newest" is the most recently completed save ----------

def test_dcp_without_collectives_is_protected_or_named(world):
    """Found by the machine (its shrink ran out of time; this is the core of it): a torch DCP
    save with ``use_collectives=False`` (``__0.metadata``, no ``.metadata``). Broke (e): once the
    system was quiet the save was neither recorded nor named in a detection problem."""
    world.save("r0", "dcp_nocoll")
    world.finish()


def test_final_model_without_a_step_is_never_lost(world):
    """Issue 27's first row as a history of the machine's rules: three step-named saves, then
    ``trainer.save_model()``'s model.safetensors, remote ``keep_last 2``, local ``keep_last 2``.
    The final model is the newest complete save; (b) says it keeps a local copy or RF good
    copies whatever rotation, the policy and collection do."""
    steps(world, lambda: world.set_keep_last(2), lambda: world.set_remote_keep_last("r0", 2))
    for _ in range(3):
        steps(world, lambda: world.save("r0", "st_step"))
    steps(world, lambda: world.save("r0", "st_final"), world.settle, world.settle, world.tick, world.gc,
          world.drain, world.settle)


# -- what --latest means; a re-save killed over a protected folder -----------------------------

def test_latest_is_lightning_last_ckpt_when_the_metric_stops_improving(world):
    """Issue 27's Lightning row with the machine's rules: ``save_top_k`` files stop improving,
    ``last.ckpt`` is rewritten each epoch. (f): latest() and the status summary give
    ``last.ckpt``, the newest complete save, not the top-k file with its step in its name."""
    steps(world, lambda: world.lightning_epoch("r0", True), lambda: world.lightning_epoch("r0", True),
          world.settle, lambda: world.lightning_epoch("r0", False), world.settle,
          lambda: world.lightning_epoch("r0", False), world.settle)


def test_restore_by_path_of_a_protected_folder_with_a_resave_killed_halfway_refuses(world):
    """A restart saves ``checkpoint-N`` again into its protected folder and dies after one
    file; ``ckpt restore PATH``. (c): refused (the files at the path are not the protected
    version), never the older version given back silently."""
    s = world.save("r0", "hf_checkpoint", sharded=True)
    steps(world, world.settle)
    assert world.protected(s), world.history
    again = world.resave(s, slow=True)
    steps(world, lambda: world.progress(again), lambda: world.kill(again))
    assert world.restore(s, "fresh", overwrite=False) == "refused", world.history
    steps(world, world.scan)
    assert world.restore(s, "fresh", overwrite=False) == "refused", world.history


def test_restore_to_a_deleted_runs_path_is_no_run_replaced(world):
    """Found by ``--model-soak 6`` (not shrunk: flaky on replay; this is its end): the user
    deletes run r1, then restores a protected checkpoint of r1 to where the run was. The
    destination does not exist, so nothing is replaced; (d) flagged every successful restore
    to a run's path, whether the run was still there or not (a checker bug, not the system's)."""
    s = world.save("r1", "st_step")
    steps(world, world.settle, lambda: world.user_delete_run("r1"))
    world.restore(s, "run", overwrite=False)
    world.check()
