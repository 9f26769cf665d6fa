"""Hostile restore requests: a destination is confined to the restore roots, never inside the
control plane's home, never onto (or above) a checkpoint that is not protected yet."""
from __future__ import annotations

import dataclasses
from itertools import pairwise
from pathlib import Path

import pytest

from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.db.transitions import transition
from pipeline.detection import catalog, completeness, roots
from pipeline.errors import RestoreError
from pipeline.restore import job as restore_job
from tests.checkpoints import atomic_save, state_dict


def _record(s: settings_mod.Settings, path: Path, *, protect: bool) -> int:
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as session:
        ckpt, job, _ = catalog.record(session, detected, lease_seconds=60, detail="test")
        if protect:
            for a, b in pairwise(["detected", "sharded", "replicated", "verified"]):
                transition(session, job.id, "store", a, b)
        return ckpt.id


@pytest.fixture
def two(db, tmp_path):
    """A protected checkpoint (step 1) and one still being stored (step 2) in run r1."""
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    done = _record(db, atomic_save(state_dict(1), run / "step_1.safetensors"), protect=True)
    _record(db, atomic_save(state_dict(2), run / "step_2.safetensors"), protect=False)
    return db, done, run


def _request(s, ref, dest, **kw):
    with session_scope(s.db_url) as session:
        return restore_job.request(session, s, ref, str(dest), **kw).params["dest"]


def test_a_destination_under_the_watched_roots_parent_is_accepted(two, tmp_path):
    s, done, run = two
    assert _request(s, done, tmp_path / "out") == str(tmp_path / "out")
    # over a protected checkpoint (say, its local copy was damaged): allowed with overwrite
    assert _request(s, done, run / "step_1.safetensors", overwrite=True) == str(run / "step_1.safetensors")


@pytest.mark.parametrize("where,said", [
    ("outside", "is outside the restore roots"),
    ("home", "inside or above the control plane's home"),
    ("above-home", "inside or above the control plane's home"),
    ("unprotected", "not protected yet"),
    ("above-unprotected", "not protected yet"),
    ("symlink-out", "is outside the restore roots"),
])
def test_hostile_destinations_are_refused(two, tmp_path, tmp_path_factory, where, said):
    s, done, run = two
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (tmp_path / "link").symlink_to(elsewhere)
    dest = {"outside": elsewhere / "x", "home": s.home / "ckpt.db", "above-home": tmp_path,
            "unprotected": run / "step_2.safetensors", "above-unprotected": run,
            "symlink-out": tmp_path / "link" / "x"}[where]
    with pytest.raises(RestoreError, match=said):
        _request(s, done, dest, overwrite=True)


def test_the_callers_directory_and_configured_roots(two, tmp_path_factory):
    s, done, _run = two
    mine = tmp_path_factory.mktemp("cwd")
    assert _request(s, done, mine / "x", extra_roots=[mine]) == str(mine / "x")
    only = dataclasses.replace(s, restore_roots=(str(mine),))
    with pytest.raises(RestoreError, match="is outside the restore roots"):
        _request(only, done, s.home.parent / "out")
    assert _request(only, done, mine / "y") == str(mine / "y")
