"""Hostile restore requests: a destination is confined to the restore roots (the watched roots,
not their parents), never inside the control plane's home, never onto (or above) a checkpoint
that is not protected yet; ``overwrite`` replaces only a protected checkpoint's restorable
content, never a root, a run, a folder being written or another host's part."""
from __future__ import annotations

import dataclasses
import os
import shutil
from itertools import pairwise
from pathlib import Path

import pytest

from pipeline import settings as settings_mod
from pipeline.db import hosts
from pipeline.db.engine import session_scope
from pipeline.db.models import CheckpointPart
from pipeline.db.transitions import transition
from pipeline.detection import catalog, completeness, roots
from pipeline.errors import DestinationExists, RestoreError
from pipeline.restoring import job as restore_job
from tests.checkpoints import atomic_save, hf_folder, state_dict


def _record(s: settings_mod.Settings, path: Path, *, protect: bool) -> int:
    run, ckpt_path = roots.locate(path, s.roots)
    detected = catalog.hash_checkpoint(run, ckpt_path, completeness.inspect(ckpt_path), shard_size=s.shard_size)
    with session_scope(s.db_url) as session:
        ckpt, job, _ = catalog.record(session, detected, lease_seconds=60, detail="test", host=s.host_id)
        if protect:
            for a, b in pairwise(["detected", "sharded", "replicated", "verified"]):
                transition(session, job.id, "store", a, b)
        return ckpt.id


@pytest.fixture
def one(db, tmp_path):
    """Run r1 with one protected checkpoint (step 1) and nothing unprotected anywhere."""
    run = tmp_path / "runs" / "r1"
    run.mkdir()
    done = _record(db, atomic_save(state_dict(1), run / "step_1.safetensors"), protect=True)
    return db, done, run


@pytest.fixture
def two(one):
    """... plus one checkpoint still being stored (step 2) in the same run."""
    s, done, run = one
    _record(s, atomic_save(state_dict(2), run / "step_2.safetensors"), protect=False)
    return s, done, run


def _request(s, ref, dest, **kw):
    with session_scope(s.db_url) as session:
        hosts.report_in(session, s.host_id, s.host_label, consumer=True)  # this host's Dramatiq runs restores
        return restore_job.request(session, s, ref, str(dest), **kw).params["dest"]


def test_a_destination_under_the_watched_root_is_accepted(two, tmp_path):
    s, done, run = two
    assert _request(s, done, run / "back.safetensors") == str(run / "back.safetensors")
    assert _request(s, done, tmp_path / "runs" / "elsewhere") == str(tmp_path / "runs" / "elsewhere")
    # over a protected checkpoint whose files are as protected: allowed with overwrite
    assert _request(s, done, run / "step_1.safetensors", overwrite=True) == str(run / "step_1.safetensors")


def test_the_watched_roots_parent_is_no_restore_root(two, tmp_path):
    """The parent of a root (a home directory, the repository with its .venv) is outside."""
    s, done, _run = two
    for dest in (tmp_path / "out", tmp_path / ".venv" / "x"):
        with pytest.raises(RestoreError, match="is outside the restore roots"):
            _request(s, done, dest)


def test_a_glob_roots_fixed_part_is_the_restore_root(db, tmp_path):
    """``data/*/runs/*``: the restore root is ``data``, not its parent; a link out of it is outside."""
    s = dataclasses.replace(db, roots=(str(tmp_path / "data" / "*" / "runs" / "*"),))
    from pipeline.restoring import destination

    assert destination.restore_roots(s) == [(tmp_path / "data").resolve()]


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
    s = dataclasses.replace(s, restore_roots=(str(tmp_path),))  # so that the home is under a restore root
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (tmp_path / "link").symlink_to(elsewhere)
    dest = {"outside": elsewhere / "x", "home": s.home / "ckpt.db", "above-home": tmp_path,
            "unprotected": run / "step_2.safetensors", "above-unprotected": run,
            "symlink-out": tmp_path / "link" / "x"}[where]
    with pytest.raises(RestoreError, match=said):
        _request(s, done, dest, overwrite=True)


def test_the_callers_directory_and_configured_roots(two, tmp_path_factory):
    s, done, run = two
    mine = tmp_path_factory.mktemp("cwd")
    assert _request(s, done, mine / "x", extra_roots=[mine]) == str(mine / "x")
    only = dataclasses.replace(s, restore_roots=(str(mine),))
    with pytest.raises(RestoreError, match="is outside the restore roots"):
        _request(only, done, s.home.parent / "out")
    assert _request(only, done, mine / "y") == str(mine / "y")
    assert _request(only, done, run / "z") == str(run / "z")  # the watched roots stay restore roots


# -- what --overwrite may replace ------------------------------------------------------------


def _refused(s, done, dest, said, **kw):
    before = _snapshot(dest)
    with pytest.raises(RestoreError, match=said) as info:
        _request(s, done, dest, overwrite=True, **kw)
    assert "restore to a new path" in str(info.value) or "not protected yet" in str(info.value)
    assert _snapshot(dest) == before  # nothing touched
    return info.value


def _snapshot(p: Path) -> dict[str, bytes]:
    if p.is_file():
        return {"": p.read_bytes()}
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def test_overwrite_never_replaces_a_run_or_a_root(one, tmp_path, tmp_path_factory):
    s, done, run = one
    _refused(s, done, run, "is the run")
    _refused(s, done, tmp_path / "runs", "restore root")
    mine = tmp_path_factory.mktemp("cwd")
    (mine / "keep").write_text("keep")
    _refused(s, done, mine, "restore root", extra_roots=[mine])
    only = dataclasses.replace(s, restore_roots=(str(mine),))
    _refused(only, done, mine, "restore root")
    # a run the database knows but no root matches any more: never replaced either
    gone = dataclasses.replace(s, roots=(str(tmp_path / "runs" / "r9*"),), restore_roots=(str(tmp_path / "runs"),))
    _refused(gone, done, run, "holds the run")


def test_overwrite_never_replaces_a_folder_being_written(one):
    """A new folder the trainer is writing (no protected version of it, unknown files)."""
    s, done, run = one
    writing = run / "checkpoint-7"
    writing.mkdir()
    (writing / "model.safetensors.tmp").write_bytes(os.urandom(1000))
    _refused(s, done, writing, "not a protected checkpoint's content")


def test_overwrite_never_replaces_a_protected_path_written_again_in_place(one):
    """Same path, new bytes (not yet recorded): the only copy of the new save."""
    s, done, run = one
    atomic_save(state_dict(11), run / "step_1.safetensors")
    _refused(s, done, run / "step_1.safetensors", "not a protected checkpoint's content")


def test_overwrite_never_replaces_files_written_within_the_settle_time(one):
    s, done, run = one
    s = dataclasses.replace(s, settle_seconds=60.0)
    os.utime(run / "step_1.safetensors")  # the bytes are the protected ones, but a writer is at it
    _refused(s, done, run / "step_1.safetensors", "written .* s ago: it may still be being written")


def test_overwrite_never_replaces_another_hosts_part(one):
    """A torch DCP step saved from several hosts: this host's directory holds another host's part."""
    s, done, run = one
    part = run / "step_9"
    part.mkdir()
    shutil.copyfile(run / "step_1.safetensors", part / "__1_0.distcp")
    with session_scope(s.db_url) as session:
        session.add(CheckpointPart(host="other-host", path=str(part), run=str(run), files=[], version="v"))
    _refused(s, done, part, "host other-host writes")
    _refused(s, done, part / "__1_0.distcp", "host other-host writes")


def test_overwrite_never_replaces_an_unprotected_checkpoint(two):
    s, done, run = two
    _refused(s, done, run / "step_2.safetensors", "not protected yet")


def test_overwrite_never_replaces_part_of_a_checkpoint_or_a_link(one, tmp_path):
    s, done, run = one
    folder = hf_folder(run / "checkpoint-5", seed=5)
    _record(s, folder, protect=True)
    inner = next(p for p in sorted(folder.iterdir()) if p.is_file())
    _refused(s, done, inner, "is inside the checkpoint")
    copy = run / "copy"
    shutil.copytree(folder, copy)
    (copy / "link").symlink_to(tmp_path)
    _refused(s, done, copy, "is a symlink")


def test_overwrite_replaces_a_protected_checkpoints_content(one, tmp_path):
    """Unchanged at its own path, a copy of it elsewhere (every file hashes as the protected
    one's), or deleted (then nothing is replaced)."""
    s, done, run = one
    assert _request(s, done, run / "step_1.safetensors", overwrite=True) == str(run / "step_1.safetensors")
    copy = tmp_path / "runs" / "copy.safetensors"
    shutil.copyfile(run / "step_1.safetensors", copy)
    assert _request(s, done, copy, overwrite=True) == str(copy)
    folder = hf_folder(run / "checkpoint-5", seed=5)
    _record(s, folder, protect=True)
    shutil.copytree(folder, run / "copy-dir")
    assert _request(s, done, run / "copy-dir", overwrite=True) == str(run / "copy-dir")
    (run / "step_1.safetensors").unlink()
    assert _request(s, done, run / "step_1.safetensors") == str(run / "step_1.safetensors")


def test_an_existing_destination_without_overwrite_is_refused(one):
    s, done, run = one
    with pytest.raises(DestinationExists):
        _request(s, done, run / "step_1.safetensors")
