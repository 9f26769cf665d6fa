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
from pipeline.errors import ConfigError
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
    # (An empty CKPT_DATABASE_URL: this shell's own choice of the home's SQLite file; with no
    # URL at all the command refuses, test_a_command_given_no_url_refuses_...)
    later = load({"home": tmp_path}, environ={"CKPT_DATABASE_URL": ""})
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


@pytest.mark.parametrize(("name", "url", "what"), [
    ("database_url", f"postgresql+psycopg://ckpt:{PASSWORD}@127.0.0.1:5432/test", "database"),
    ("redis_url", f"redis://:{PASSWORD}@127.0.0.1:6379/0", "broker"),
])
def test_a_command_given_no_url_refuses_rather_than_use_another_control_plane(tmp_path, name, url, what):
    """`ckpt up` runs with a URL whose password the record masks: a later command with none of
    its own would have used the home's own SQLite file or embedded Redis, a second, empty control
    plane. It refuses and names what to set; given the URL (env, flag, or the same in
    config.toml) it runs."""
    var = f"CKPT_{name.upper()}"
    up = load({"home": tmp_path}, environ={var: url})
    effective.write(up, {name: "env"})
    hidden = url.replace(PASSWORD, "***")
    with pytest.raises(ConfigError) as caught:
        load({"home": tmp_path}, environ={})
    assert str(caught.value) == (f"`ckpt up` of home {tmp_path} runs with {what} {hidden}: set {var} to the same "
                                 "URL in this shell")
    assert getattr(load({"home": tmp_path}, environ={var: url}), name) == url
    assert getattr(load({"home": tmp_path, name: url}, environ={}), name) == url
    (tmp_path / "config.toml").write_text(f"{name} = {effective.toml_value(url)}\n")
    (tmp_path / "config.toml").chmod(0o600)
    assert getattr(load({"home": tmp_path}, environ={}), name) == url
    (tmp_path / "config.toml").write_text(f"{name} = {effective.toml_value(url.replace('127.0.0.1', 'other'))}\n")
    with pytest.raises(ConfigError, match=f"set {var}"):
        load({"home": tmp_path}, environ={})


def test_ckpt_status_in_another_shell_refuses_to_use_an_empty_control_plane(tmp_path):
    url = f"postgresql+psycopg://ckpt:{PASSWORD}@127.0.0.1:5432/test"
    effective.write(load({"home": tmp_path}, environ={"CKPT_DATABASE_URL": url}), {"database_url": "env"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--home", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"ckpt: error: `ckpt up` of home {tmp_path} runs with database postgresql+psycopg://ckpt:***@127.0.0.1:5432"
            "/test: set CKPT_DATABASE_URL to the same URL in this shell") in r.stderr
    assert not (tmp_path / "ckpt.db").exists()  # no second control plane was started


@pytest.mark.parametrize(("name", "url"), [
    ("database_url", "postgresql+psycopg://ckpt@127.0.0.1:5432/test"),
    # SQLAlchemy would render this one differently (%20 as +): it is not re-rendered either.
    ("database_url", "postgresql+psycopg://ckpt@127.0.0.1:5432/test?options=-c%20search_path%3Dckpt"),
    ("redis_url", "redis://127.0.0.1:6379/0?db=1"),
    ("redis_url", "unix:///run/redis/redis.sock?db=2"),
])
def test_a_url_without_a_password_is_recorded_and_loaded_back_as_it_is(tmp_path, name, url):
    effective.write(load({"home": tmp_path}, environ={f"CKPT_{name.upper()}": url}), {name: "env"})
    record = effective.read(tmp_path)
    assert record is not None and record.values[name] == url and name not in record.masked
    s, sources = explain({"home": tmp_path}, environ={})
    assert getattr(s, name) == url and sources[name] == "ckpt up (env)"
