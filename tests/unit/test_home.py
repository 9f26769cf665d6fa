"""The CLI finds its home the way git finds its repository (pipeline/home.py)."""
from __future__ import annotations

import pytest

from pipeline import home
from pipeline.cli.main import build_parser


def test_the_home_is_the_flag_then_the_environment_then_the_nearest_then_the_users(tmp_path):
    project, user = tmp_path / "project", tmp_path / "data"
    deep = project / "a" / "b"
    deep.mkdir(parents=True)
    env = {"XDG_DATA_HOME": str(user)}
    new = home.find(None, env, deep)
    assert (new.how, new.path, new.exists) == ("new", deep / ".ckpt", False)
    assert str(deep) in new.missing() and str(user / "ckpt") in new.missing()

    (user / "ckpt").mkdir(parents=True)
    assert (home.find(None, env, deep).how, home.find(None, env, deep).path) == ("user", user / "ckpt")
    (project / ".ckpt").mkdir()
    assert (home.find(None, env, deep).how, home.find(None, env, deep).path) == ("found", project / ".ckpt")
    assert home.find(None, {**env, "CKPT_HOME": str(tmp_path / "h")}, deep).path == tmp_path / "h"
    assert home.find(str(tmp_path / "f"), {**env, "CKPT_HOME": str(tmp_path / "h")}, deep).path == tmp_path / "f"
    (project / "a" / ".ckpt").write_text("a file is not a home")
    assert home.find(None, env, deep).path == project / ".ckpt"


@pytest.mark.parametrize("argv", [["--home", "/x", "status"], ["status", "--home", "/x"],
                                  ["restore", "1", "--to", "d", "--home", "/x"], ["policy", "--home", "/x"],
                                  ["up", "--home", "/x"]])
def test_home_is_accepted_before_and_after_the_command(argv):
    assert build_parser().parse_args(argv).home == "/x"


def test_without_home_the_flag_is_unset():
    assert build_parser().parse_args(["status"]).home is None
