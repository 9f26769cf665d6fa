"""Settings: defaults < running ckpt up < config file < environment < flags."""
from __future__ import annotations

import json

import pytest

from pipeline.errors import ConfigError
from pipeline.settings import load


def test_precedence(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    (home / "up.json").write_text(json.dumps({"roots": ["/from/up"]}))
    assert load({"home": home}, environ={}).roots == ("/from/up",)
    (home / "config.toml").write_text('rf = 3\nroots = ["/from/config"]\nshard_size = 8192\n')
    s = load({"home": home}, environ={"CKPT_RF": "4"})
    assert (s.rf, s.roots, s.shard_size) == (4, ("/from/config",), 8192)
    assert load({"home": home, "rf": 5}, environ={"CKPT_RF": "4"}).rf == 5


def test_defaults_need_no_servers(tmp_path):
    s = load({"home": tmp_path}, environ={})
    assert s.db_url.startswith("sqlite:///") and s.broker_url.startswith("unix://") and s.embedded_redis


@pytest.mark.parametrize("env,needle", [
    ({"CKPT_RF": "two"}, "rf: 'two' is not a valid int"),
    ({"CKPT_RF": "0"}, "rf must be at least 1"),
    ({"CKPT_SHARD_SIZE": "10"}, "shard_size must be at least 4096"),
])
def test_bad_values_are_named(tmp_path, env, needle):
    with pytest.raises(ConfigError, match=needle):
        load({"home": tmp_path}, environ=env)


def test_unknown_config_key_is_refused(tmp_path):
    (tmp_path / "config.toml").write_text("replication = 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'replication'"):
        load({"home": tmp_path}, environ={})


def test_cluster_key_is_created_once_and_private(tmp_path):
    s = load({"home": tmp_path}, environ={})
    key = s.key()
    assert len(key) == 64 and s.key() == key
    assert (tmp_path / "cluster.key").stat().st_mode & 0o777 == 0o600


def test_remote_retention_per_run_tables_override_the_global_policy(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    (home / "config.toml").write_text(
        'remote_keep_last = 5\nremote_keep_daily = 7\n'
        '[runs."/data/runs/llama-*"]\nkeep_last = 3\nkeep_best = 2\nbest_metric = "eval_loss"\n')
    s = load({"home": home}, environ={})
    assert s.policy_for("/data/runs/other").describe() == "last 5, 7 daily"
    assert s.policy_for("/data/runs/llama-7b").describe() == "last 3, 7 daily, best 2 by min eval_loss"
    assert not load({"home": tmp_path}, environ={}).policy_for("/r").is_set  # the default keeps everything


@pytest.mark.parametrize("text,needle", [
    ('[runs."/r"]\nkeep_lst = 3\n', "unknown option 'keep_lst'"),
    ('[runs."/r"]\nkeep_best = 3\n', "keep_best needs best_metric"),
    ('[runs."/r"]\nbest_mode = "median"\n', "best_mode must be min or max"),
    ('remote_keep_last = -1\n', "keep counts must be >= 0"),
])
def test_bad_retention_settings_are_named(tmp_path, text, needle):
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load({"home": tmp_path}, environ={})
