"""The settings a running ``ckpt up`` records for later commands (pipeline/effective.py), and
relative paths made absolute as settings are read (pipeline/settings.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import tomllib

import pytest

from pipeline import effective
from pipeline.settings import explain, load

PASSWORD = "s3cret-pw"


def test_the_record_is_private_holds_no_secret_and_gives_back_every_other_value(tmp_path):
    env = {"CKPT_CLUSTER_KEY": "the-cluster-key", "CKPT_DATABASE_URL": f"postgresql://ckpt:{PASSWORD}@db/ckpt",
           "CKPT_REMOTE_KEEP_LAST": "2", "CKPT_ROOTS": "/data/runs/*,/other",
           "CKPT_COMMIT_MARKER": 'odd "quoted"\\name\x7f\n', "CKPT_SPARSE_RATIO": "0.5"}
    up = load({"home": tmp_path}, environ=env)
    path = effective.write(up, {"remote_keep_last": "env"})
    text = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "the-cluster-key" not in text and PASSWORD not in text and "ckpt:***@db" in text
    data = tomllib.loads(text)
    assert data["masked"] == {"cluster_key": "***", "database_url": "postgresql://ckpt:***@db/ckpt"}
    later = load({"home": tmp_path}, environ={})
    secret = {"cluster_key", "database_url", "home", "ready_dir"}
    for f in dataclasses.fields(up):
        if f.name not in secret:
            assert getattr(later, f.name) == getattr(up, f.name), f.name
    assert later.cluster_key == "" and later.database_url == ""  # never loaded from the record


def test_a_record_whose_ckpt_up_is_gone_or_on_another_machine_is_not_applied(tmp_path):
    up = load({"home": tmp_path}, environ={"CKPT_RF": "3"})
    path = effective.write(up, {"rf": "env"})
    assert load({"home": tmp_path}, environ={}).rf == 3
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    text = path.read_text()
    path.write_text(text.replace(f"pid = {os.getpid()}", f"pid = {dead.pid}"))
    s, sources = explain({"home": tmp_path}, environ={})
    assert s.rf == 2 and sources["rf"] == "default"
    assert "is gone" in effective.read(tmp_path).ignored
    path.write_text(text.replace('machine = "', 'machine = "elsewhere-'))
    assert load({"home": tmp_path}, environ={}).rf == 2
    effective.remove(tmp_path)  # another machine's record: not this process's to remove
    assert path.exists()
    path.write_text(text)
    effective.remove(tmp_path)
    assert not path.exists()


def test_relative_paths_become_absolute_from_where_they_were_given(tmp_path, monkeypatch):
    project = tmp_path / "project"
    sub = project / "notebooks"
    sub.mkdir(parents=True)
    home = project / ".ckpt"
    home.mkdir()
    (home / "config.toml").write_text(
        'restore_roots = ["restores", "~/r"]\n'
        '[roots."runs/*"]\nquiet_seconds = 5\n'
        '[runs."runs/llama-*"]\nkeep_last = 3\n'
        '[runs."*/gpt-*"]\nkeep_last = 4\n')
    monkeypatch.chdir(sub)
    # From config.toml: from the directory that holds the home, wherever the command runs.
    s = load({"home": home}, environ={"CKPT_ROOTS": "../runs/*"})
    assert s.restore_roots == (str(project / "restores"), os.path.expanduser("~/r"))
    # From env (and flags): from this command's directory.
    assert s.roots == (str(project / "runs" / "*"),)
    assert s.options_for(s.roots[0]).quiet_seconds == 5  # the [roots."runs/*"] table is that same root
    assert s.policy_for(str(project / "runs" / "llama-7b")).keep_last == 3
    assert s.policy_for("/elsewhere/gpt-2").keep_last == 4  # a glob from a wildcard matches anywhere
    assert load({"home": home, "roots": ("here",)}, environ={}).roots == (str(sub / "here"),)


@pytest.mark.parametrize("value", ["plain", 'q"uote\\back\x00\x1f\x7f\t\nü', 3, 0.1, 1e300, float("inf"),
                                   ("a", "b,c"), ()])
def test_toml_values_round_trip(value):
    assert tomllib.loads(f"v = {effective.toml_value(value)}")["v"] == (list(value) if isinstance(value, tuple)
                                                                         else value)


def test_the_record_loads_through_json_tables(tmp_path):
    tables = json.dumps({"/runs/*": {"quiet_seconds": 7.0}})
    up = load({"home": tmp_path, "root_options": tables, "roots": ("/runs/*",)}, environ={})
    effective.write(up, {})
    assert load({"home": tmp_path}, environ={}).options_for("/runs/*").quiet_seconds == 7.0


def test_ckpt_config_masks_a_webhooks_token_as_the_record_does(tmp_path):
    """A Slack-style hook carries its token in the path: `ckpt config` printed it whole."""
    from pipeline.cli.config_cmd import shown

    hook = "https://hooks.example.com/services/T000/B000/s3cr3tT0ken?x=1"
    s = load({"home": tmp_path / "home", "alert_webhook": hook}, environ={})
    assert shown(s, "alert_webhook") == "https://hooks.example.com/***"
    assert effective.secret_form("alert_webhook", "https://u:pw@h.example/") == "https://u:***@h.example"
    assert effective.secret_form("alert_webhook", "https://h.example") is None
