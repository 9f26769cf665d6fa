"""The rotation trash puts an entry back without ever replacing what took its path since."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.store import trash


@pytest.fixture(autouse=True, params=["renameat2", "link"])
def noreplace(request, monkeypatch):
    """Each test with the kernel's no-replace rename, and as on a system without it."""
    if request.param == "link":
        monkeypatch.setattr(trash, "_renameat2", lambda: None)
    else:
        assert trash._renameat2() is not None  # glibc >= 2.28 has it
    return request.param


def _entry(run, name: str, *, directory: bool = False):
    path = run / name
    if directory:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"old")
    else:
        path.write_bytes(b"old")
    return path, trash.move_to_trash(path)


@pytest.mark.parametrize("directory", [False, True])
def test_an_entry_goes_back_to_its_path_when_nothing_took_it(tmp_path, directory):
    path, entry = _entry(tmp_path, "checkpoint-7" if directory else "step_7.safetensors", directory=directory)
    assert trash.restore(entry, path) == path
    assert not os.path.lexists(entry)
    assert (path / "model.safetensors" if directory else path).read_bytes() == b"old"


def test_a_file_that_took_the_path_is_never_replaced(tmp_path):
    path, entry = _entry(tmp_path, "step_7.safetensors")
    path.write_bytes(b"newer save")
    back = trash.restore(entry, path)
    assert path.read_bytes() == b"newer save"
    assert back != path and back.parent == tmp_path and back.read_bytes() == b"old"
    assert back.name.startswith("step_7.kept-") and back.name.endswith(".safetensors")
    assert not trash.entries(tmp_path)  # out of the trash: nothing will delete it as a rotation's leftover


@pytest.mark.parametrize("taken_by", ["directory with files", "file", "empty directory"])
def test_a_directory_entry_never_replaces_what_took_its_path(tmp_path, taken_by):
    path, entry = _entry(tmp_path, "checkpoint-7", directory=True)
    if taken_by == "file":
        path.write_bytes(b"newer save")
    else:
        path.mkdir()
        if taken_by == "directory with files":
            (path / "model.safetensors").write_bytes(b"newer save")
    back = trash.restore(entry, path)
    assert back != path and (back / "model.safetensors").read_bytes() == b"old"
    if taken_by != "empty directory":
        assert (path.read_bytes() if taken_by == "file" else (path / "model.safetensors").read_bytes()) == b"newer save"
    assert not trash.entries(tmp_path)


def test_a_symlinked_checkpoint_goes_back_as_the_link(tmp_path):
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(b"old")
    link = tmp_path / "step_7.safetensors"
    link.symlink_to(target)
    entry = trash.move_to_trash(link)
    assert trash.restore(entry, link) == link
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_bytes() == b"old"


def test_put_back_never_replaces_a_save_that_took_the_path_while_it_checked(tmp_path, monkeypatch):
    path, entry = _entry(tmp_path, "step_7.safetensors")
    files = trash._files(Path(entry))
    real = trash._files

    def save_lands(e):  # the trainer's save lands between put_back's checks and its rename
        path.write_bytes(b"newer save")
        return real(e)

    monkeypatch.setattr(trash, "_files", save_lands)
    assert not trash.put_back(path, files)
    assert path.read_bytes() == b"newer save" and (Path(entry)).read_bytes() == b"old"
