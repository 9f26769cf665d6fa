"""Settings: defaults < config file < running ckpt up < environment < flags."""
from __future__ import annotations

import pytest

from pipeline import effective
from pipeline.errors import ConfigError
from pipeline.settings import explain, load


def test_precedence(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    (home / "config.toml").write_text('rf = 3\nroots = ["/from/config"]\nshard_size = 8192\n')
    s = load({"home": home}, environ={"CKPT_RF": "4"})
    assert (s.rf, s.roots, s.shard_size) == (4, ("/from/config",), 8192)
    assert load({"home": home, "rf": 5}, environ={"CKPT_RF": "4"}).rf == 5
    # What the running `ckpt up` records comes over config.toml, under this command's env and flags.
    up = load({"home": home, "roots": ("/from/up",)}, environ={"CKPT_GC_GRACE_SECONDS": "0"})
    effective.write(up, {"roots": "flag", "gc_grace_seconds": "env", "rf": "config.toml"})
    s, sources = explain({"home": home}, environ={"CKPT_SHARD_SIZE": "16384"})
    assert (s.rf, s.roots, s.gc_grace_seconds, s.shard_size) == (3, ("/from/up",), 0.0, 16384)
    assert (sources["roots"], sources["gc_grace_seconds"], sources["rf"], sources["shard_size"],
            sources["keep_last"]) == ("ckpt up (flag)", "ckpt up (env)", "ckpt up (config.toml)", "env",
                                      "ckpt up (default)")
    assert load({"home": home}, environ={"CKPT_ROOTS": "/mine"}).roots == ("/mine",)
    assert load({"home": home, "roots": ("/flag",)}, environ={"CKPT_ROOTS": "/mine"}).roots == ("/flag",)
    assert load({"home": home}, environ={}, recorded=False).roots == ("/from/config",)  # `ckpt up` itself


def test_an_empty_variable_gives_the_empty_value_where_empty_means_something(tmp_path):
    """`CKPT_SCRUB_CRON=` disables the scrub as documented (an empty variable used to be ignored,
    so the default schedule ran); `CKPT_RESTORE_ROOTS=` names none even when the running `ckpt up`
    recorded some; an empty number or choice is still "not given"."""
    home = tmp_path / "h"
    home.mkdir()
    (home / "config.toml").write_text('scrub_cron = "0 1 * * *"\nrf = 3\n')
    up = load({"home": home, "restore_roots": ("/from/up",)}, environ={})
    effective.write(up, {"restore_roots": "flag"})
    s = load({"home": home}, environ={"CKPT_SCRUB_CRON": "", "CKPT_GC_CRON": "", "CKPT_RESTORE_ROOTS": "",
                                      "CKPT_RF": "", "CKPT_REPLICATION": ""})
    assert (s.scrub_cron, s.gc_cron, s.restore_roots) == ("", "", ())
    assert (s.rf, s.replication) == (3, "chain")
    assert load({"home": home}, environ={}).restore_roots == ("/from/up",)


def test_defaults_need_no_servers(tmp_path):
    s = load({"home": tmp_path}, environ={})
    assert s.db_url.startswith("sqlite:///") and s.broker_url.startswith("unix://") and s.embedded_redis


@pytest.mark.parametrize("env,needle", [
    ({"CKPT_RF": "two"}, "rf: 'two' is not a valid int"),
    ({"CKPT_RF": "0"}, "rf must be at least 1"),
    ({"CKPT_SHARD_SIZE": "10"}, "shard_size must be at least 4096"),
    ({"CKPT_REPLICATION": "broadcast"}, "replication must be one of chain, fanout"),
])
def test_bad_values_are_named(tmp_path, env, needle):
    with pytest.raises(ConfigError, match=needle):
        load({"home": tmp_path}, environ=env)


def test_unknown_config_key_is_refused(tmp_path):
    (tmp_path / "config.toml").write_text("replicas = 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'replicas'"):
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


def test_a_run_table_sets_the_workers_rf_of_its_runs(tmp_path):
    (tmp_path / "config.toml").write_text('rf = 2\n[runs."/data/runs/big-*"]\nrf = 3\n[runs."/data/runs/scratch"]\n'
                                          'keep_last = 1\n')
    s = load({"home": tmp_path}, environ={})
    assert (s.rf_for("/data/runs/big-1"), s.rf_for("/data/runs/scratch"), s.rf_for("/elsewhere")) == (3, 2, 2)
    assert s.need_for("/data/runs/big-1").rf == 3 and s.rf_per_run() and s.rf_said() == "their RF"
    (tmp_path / "config.toml").write_text('rf = 3\n[runs."/data/runs/big-*"]\nrf = 3\n')
    assert not load({"home": tmp_path}, environ={}).rf_per_run()  # the same as the global: nothing to ask per run


@pytest.mark.parametrize("text,needle", [
    ('[runs."/r"]\nkeep_lst = 3\n', "unknown option 'keep_lst'"),
    ('[runs."/r"]\nkeep_best = 3\n', "keep_best needs best_metric"),
    ('[runs."/r"]\nbest_mode = "median"\n', "best_mode must be min or max"),
    ('remote_keep_last = -1\n', "keep counts must be >= 0"),
    ('[runs."/r"]\nrf = 0\n', r"runs\.'/r'\.rf must be at least 1, got 0"),
    ('[runs."/r"]\nrf = "two"\n', r"runs\.'/r'\.rf: 'two' is not a valid int"),
])
def test_bad_retention_settings_are_named(tmp_path, text, needle):
    (tmp_path / "config.toml").write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load({"home": tmp_path}, environ={})


def test_private_files_are_0600_even_over_a_looser_leftover(tmp_path):
    import os
    import stat

    from pipeline.durable import open_private_log, write_private

    path = tmp_path / "up.json"
    leftover = tmp_path / f".up.json.{os.getpid()}.tmp"
    leftover.write_text("old")
    leftover.chmod(0o644)
    write_private(path, '{"database": "postgresql://u:p@h/db"}')
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "postgresql" in path.read_text()
    os.close(open_private_log(tmp_path / "x.log"))
    assert stat.S_IMODE((tmp_path / "x.log").stat().st_mode) == 0o600


def test_a_config_holding_a_password_that_others_can_read_is_warned_about(tmp_path, caplog):
    from pipeline import settings as settings_mod

    home = tmp_path / "home"
    home.mkdir()
    config = home / "config.toml"
    config.write_text('database_url = "postgresql+psycopg://ckpt:s3cret@db/ckpt"\n')
    config.chmod(0o644)
    settings_mod.load({"home": home}, environ={})
    assert "chmod 600" in caplog.text and "s3cret" not in caplog.text
    caplog.clear()
    config.chmod(0o600)
    settings_mod.load({"home": home}, environ={})
    assert "chmod 600" not in caplog.text
