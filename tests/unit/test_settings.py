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
