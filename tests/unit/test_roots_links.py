"""Symlinks under a root: followed while they stay inside it, refused and listed otherwise (issue 27).

Given a glob root ``data/*/runs/*`` whose matches go through links (one that stays inside
``data``, one to another user's directory) and runs holding symlinked checkpoints, When the
watcher scans and a rotation deletes, Then what stays inside is recorded under the path the
user sees, what leads out is never a run nor a checkpoint but is listed in "not protected"
with the reason, ``locate`` follows the same rules, and deleting never follows a link out.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, DetectionProblem
from pipeline.detection import roots
from pipeline.detection.watcher import Watcher
from pipeline.errors import OutsideRoots
from pipeline.store import trash
from tests.checkpoints import atomic_save, state_dict


@pytest.fixture
def tree(db, tmp_path):
    data = tmp_path / "data"
    own = data / "store" / "mine"           # a user's runs, reached through data/x (inside data)
    (own / "runs" / "r1").mkdir(parents=True)
    atomic_save(state_dict(1), own / "runs" / "r1" / "step_1.safetensors")
    os.symlink(own, data / "x")
    blobs = data / "store" / "blobs"        # weights kept elsewhere in data, linked into the run
    blobs.mkdir()
    atomic_save(state_dict(2), blobs / "w.safetensors")
    os.symlink(blobs / "w.safetensors", own / "runs" / "r1" / "step_2.safetensors")
    os.symlink("step_1.safetensors", own / "runs" / "r1" / "latest.safetensors")  # a pointer
    victim = tmp_path / "victim"            # another user's directory: data/v leads there
    (victim / "runs" / "r9").mkdir(parents=True)
    atomic_save(state_dict(3), victim / "runs" / "r9" / "step_9.safetensors")
    os.symlink(victim, data / "v")
    secret = tmp_path / "secret.safetensors"
    atomic_save(state_dict(4), secret)
    os.symlink(secret, own / "runs" / "r1" / "step_3.safetensors")  # a checkpoint link out of the root
    settings = dataclasses.replace(db, roots=(str(data / "*" / "runs" / "*"),))
    return settings, data, victim


def recorded(settings) -> dict[str, Checkpoint]:
    with session_scope(settings.db_url) as s:
        return {c.path: c for c in s.scalars(select(Checkpoint))}


def problems_of(settings) -> dict[str, str]:
    with session_scope(settings.db_url) as s:
        return {p.path: p.reason for p in s.scalars(select(DetectionProblem))}


def test_links_inside_the_root_are_followed_and_named_as_the_user_sees_them(tree):
    settings, data, _victim = tree
    run = data / "x" / "runs" / "r1"
    assert roots.runs(settings.roots) == [run]
    sent: list = []
    w = Watcher(settings, sent.extend, use_events=False)
    w.scan()
    got = recorded(settings)
    assert sorted(got) == [str(run / "step_1.safetensors"), str(run / "step_2.safetensors")]
    assert {c.run for c in got.values()} == {str(run)}
    assert len(sent) == 2


def test_a_glob_through_a_link_out_of_the_root_makes_no_run_and_is_listed(tree):
    settings, data, victim = tree
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    w.scan()
    assert not [p for p in recorded(settings) if "victim" in p or "/v/" in p]
    listed = problems_of(settings)
    reason = listed[str(data / "v" / "runs" / "r9")]
    assert "outside the root" in reason and str(victim) in reason
    assert "outside the root" in listed[str(data / "x" / "runs" / "r1" / "step_3.safetensors")]
    assert (victim / "runs" / "r9" / "step_9.safetensors").exists()


def test_a_refused_run_leaves_the_list_when_its_link_is_gone(tree):
    settings, data, _victim = tree
    w = Watcher(settings, [].extend, use_events=False)
    w.scan()
    os.unlink(data / "v")
    w.scan()
    assert str(data / "v" / "runs" / "r9") not in problems_of(settings)


def test_locate_follows_the_same_rules(tree):
    settings, data, victim = tree
    run = data / "x" / "runs" / "r1"
    assert roots.locate(run / "step_2.safetensors", settings.roots) == (run, run / "step_2.safetensors")
    with pytest.raises(OutsideRoots):
        roots.locate(data / "v" / "runs" / "r9" / "step_9.safetensors", settings.roots)
    with pytest.raises(OutsideRoots):
        roots.locate(victim / "runs" / "r9" / "step_9.safetensors", settings.roots)
    with pytest.raises(OutsideRoots):
        roots.locate(run / "step_3.safetensors", settings.roots)


def test_rotating_a_symlinked_checkpoint_removes_the_link_never_its_target(tree):
    settings, data, _victim = tree
    run = data / "x" / "runs" / "r1"
    base = roots.base_for(run, settings.roots)
    assert base == data.resolve()
    entry = Path(trash.move_to_trash(run / "step_2.safetensors", inside=base))
    trash.remove(entry, inside=base)
    assert not os.path.lexists(run / "step_2.safetensors") and not os.path.lexists(entry)
    assert (data / "store" / "blobs" / "w.safetensors").exists()


def test_deleting_never_follows_a_link_retargeted_out_of_the_root(tree):
    settings, data, victim = tree
    run = data / "x" / "runs" / "r1"
    base = roots.base_for(run, settings.roots)
    os.unlink(data / "x")                   # after detection, data/x now leads to the victim
    os.symlink(victim, data / "x")
    (victim / "runs" / "r1").mkdir()
    atomic_save(state_dict(5), victim / "runs" / "r1" / "step_1.safetensors")
    assert roots.base_for(run, settings.roots) is None
    with pytest.raises(OutsideRoots):
        trash.move_to_trash(run / "step_1.safetensors", inside=base)
    assert (victim / "runs" / "r1" / "step_1.safetensors").exists()
