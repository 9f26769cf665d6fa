"""The staging entry of a restore is written through descriptors: a link planted inside it, at
its name, or on the way to it never receives a byte."""
from __future__ import annotations

import os

import pytest

from pipeline.errors import UnsafeDestination
from pipeline.restoring.staging import Staging, open_dir


def test_a_link_planted_inside_the_staging_directory_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    staging = Staging(tmp_path, ".dest.ckpt-restore-1.1", is_dir=True)
    try:
        staging.create()
        (tmp_path / ".dest.ckpt-restore-1.1" / "sub").symlink_to(victim)
        with pytest.raises(UnsafeDestination, match="something was put inside its staging directory"):
            staging.place("sub/model.safetensors")
        fd, name = staging.place("other/model.safetensors")  # a directory the restore made itself
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, dir_fd=fd))
        staging.still_ours()
    finally:
        staging.close()
    assert list(victim.iterdir()) == []
    assert (tmp_path / ".dest.ckpt-restore-1.1" / "other" / "model.safetensors").is_file()


def test_a_link_left_at_the_staging_name_is_removed_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / ".dest.ckpt-restore-1.1").symlink_to(victim)
    staging = Staging(tmp_path, ".dest.ckpt-restore-1.1", is_dir=True)
    try:
        staging.create()
        staging.place("x")
    finally:
        staging.close()
    assert victim.is_dir() and list(victim.iterdir()) == []
    assert (tmp_path / ".dest.ckpt-restore-1.1").is_dir() and not (tmp_path / ".dest.ckpt-restore-1.1").is_symlink()


def test_the_destinations_directory_is_reached_without_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.close(open_dir(tmp_path / "real"))
    with pytest.raises(UnsafeDestination, match="reached without a symlink"):
        open_dir(tmp_path / "link")
    with pytest.raises(UnsafeDestination, match="reached without a symlink"):
        Staging(tmp_path / "link", ".x", is_dir=False)
