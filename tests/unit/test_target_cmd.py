"""``ckpt target`` without a store (``--no-check``; the check against a real S3 server is
tests/objectstore/test_target_cmd.py): what add writes is what the settings load, duplicates and
bad values are refused with config.toml untouched, remove takes one table, and the errors for no
home, an unknown name, a file that does not parse and a target from CKPT_TARGETS."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline import effective
from pipeline import settings as settings_mod
from pipeline.cli.main import main

BEFORE = '# my settings\nrf = 2  # two copies\n\n[runs."x/*"]\nkeep_last = 3\n'


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home with a config.toml of its own, and no AWS credentials to find anywhere."""
    for name in ("CKPT_HOME", "CKPT_TARGETS", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    h = tmp_path / "home"
    h.mkdir()
    (h / "config.toml").write_text(BEFORE)
    return h


def ckpt(home: Path, capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["--home", str(home), "target", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_added_target_is_what_the_settings_load_and_the_rest_of_the_file_is_kept(home, capsys):
    rc, out, _ = ckpt(home, capsys, "add", "s3://ckpt-archive//team-a/", "--endpoint", "http://st1:8333",
                      "--region", "us-east-1", "--profile", "ckpt", "--addressing-style", "path", "--sse", "AES256",
                      "--quota", "500GB", "--no-check")
    assert rc == 0
    assert "added target ckpt-archive (s3://ckpt-archive/team-a)" in out and "restart" not in out
    text = (home / "config.toml").read_text()
    assert text.startswith(BEFORE) and '\nurl = "s3://ckpt-archive/team-a"\n' in text  # as the loader reads it
    [t] = settings_mod.load({"home": home}, environ={}).object_targets()
    assert (t.name, t.bucket, t.prefix, t.endpoint, t.region, t.profile, t.addressing_style, t.sse, t.quota_bytes) == (
        "ckpt-archive", "ckpt-archive", "team-a", "http://st1:8333", "us-east-1", "ckpt", "path", "AES256", 500 * 10**9)


def test_a_home_without_config_toml_gets_a_private_one(home, capsys):
    (home / "config.toml").unlink()
    assert ckpt(home, capsys, "add", "s3://bucket-a", "--no-check")[0] == 0
    assert (home / "config.toml").stat().st_mode & 0o777 == 0o600
    assert (home / "config.toml").read_text() == '[[targets]]\nname = "bucket-a"\nurl = "s3://bucket-a"\n'


def test_the_default_name_is_the_buckets_made_unique_and_a_name_or_url_twice_is_refused(home, capsys):
    assert ckpt(home, capsys, "add", "s3://bucket-a/p", "--no-check")[0] == 0
    assert ckpt(home, capsys, "add", "s3://bucket-a/q", "--no-check")[0] == 0
    after = (home / "config.toml").read_text()
    names = [t.name for t in settings_mod.load({"home": home}, environ={}).object_targets()]
    assert names == ["bucket-a", "bucket-a-2"]
    rc, _, err = ckpt(home, capsys, "add", "s3://bucket-z", "--name", "bucket-a", "--no-check")
    assert rc == 1 and "a target named 'bucket-a' is already in" in err
    rc, _, err = ckpt(home, capsys, "add", "s3://bucket-a/p/", "--name", "other", "--no-check")
    assert rc == 1 and "s3://bucket-a/p is already target 'bucket-a'" in err
    # the same bucket and prefix on another store is another target
    assert ckpt(home, capsys, "add", "s3://bucket-a/p", "--endpoint", "http://st1:8333", "--no-check")[0] == 0
    assert (home / "config.toml").read_text().startswith(after)


@pytest.mark.parametrize(("args", "needle"), [
    (["s3://Bad_Bucket"], "not a valid bucket name"),
    (["s3://bucket-a", "--endpoint", "st1:8333"], "endpoint must be http(s)://host[:port]"),
    (["s3://bucket-a", "--addressing-style", "sideways"], "addressing_style must be one of"),
    (["s3://bucket-a", "--sse-kms-key-id", "k"], 'sse_kms_key_id needs sse = "aws:kms"'),
    (["s3://bucket-a", "--name", "a b"], "name must be 1-63 letters"),
])
def test_a_bad_value_is_refused_by_the_loaders_own_check_and_nothing_is_written(home, capsys, args, needle):
    rc, _, err = ckpt(home, capsys, "add", *args, "--no-check")
    assert rc == 1 and needle in err
    assert (home / "config.toml").read_text() == BEFORE


def test_remove_takes_that_table_only_and_says_the_bucket_keeps_its_copies(home, capsys):
    with (home / "config.toml").open("a") as f:
        f.write('\n[[targets]]\nname = "a"\nurl = "s3://bucket-a"\n# after a\n\n[[targets]]\nname = "b"\n'
                'url = "s3://bucket-b"\n')
    rc, out, _ = ckpt(home, capsys, "remove", "a")
    assert rc == 0 and "removed target a (s3://bucket-a)" in out and "not deleted" in out
    assert (home / "config.toml").read_text() == BEFORE + '\n# after a\n\n[[targets]]\nname = "b"\nurl = "s3://bucket-b"\n'


def test_a_table_the_loader_refuses_can_still_be_removed(home, capsys):
    """A key in the configuration makes every command refuse to start: `remove` is the way out."""
    with (home / "config.toml").open("a") as f:
        f.write('\n[[targets]]\nname = "leaky"\nurl = "s3://bucket-a"\naws_secret_access_key = "x"\n')
    assert ckpt(home, capsys, "list")[0] == 1
    assert ckpt(home, capsys, "remove", "leaky")[0] == 0
    assert (home / "config.toml").read_text() == BEFORE


def test_an_unknown_name_is_an_error_naming_the_targets_there(home, capsys):
    ckpt(home, capsys, "add", "s3://bucket-a", "--no-check")
    rc, _, err = ckpt(home, capsys, "remove", "nope")
    assert rc == 1 and "no target named 'nope'" in err and "its targets: bucket-a" in err


def test_a_target_of_ckpt_targets_cannot_be_removed_from_config_toml(home, capsys, monkeypatch):
    monkeypatch.setenv("CKPT_TARGETS", json.dumps([{"name": "envt", "url": "s3://env-bucket"}]))
    rc, _, err = ckpt(home, capsys, "remove", "envt")
    assert rc == 1 and "'envt' is defined in CKPT_TARGETS" in err
    rc, out, _ = ckpt(home, capsys, "add", "s3://bucket-a", "--no-check")
    assert rc == 0 and "CKPT_TARGETS is set" in out
    rc, out, _ = ckpt(home, capsys, "list", "--json")
    assert [(r["name"], r["source"]) for r in json.loads(out)] == [("bucket-a", "config.toml"),
                                                                   ("envt", "CKPT_TARGETS")]


def test_a_config_toml_that_does_not_parse_is_named_with_its_line(home, capsys):
    (home / "config.toml").write_text(BEFORE + "keep_last = = 3\n")
    for args in (["list"], ["remove", "a"], ["add", "s3://bucket-a", "--no-check"]):
        rc, _, err = ckpt(home, capsys, *args)
        assert rc == 1 and "config.toml: Invalid value (at line 6" in err, args


def test_no_home_is_an_error_saying_where_it_looked(tmp_path, capsys):
    for args in (["list"], ["remove", "a"], ["add", "s3://bucket-a", "--no-check"]):
        rc, _, err = ckpt(tmp_path / "none", capsys, *args)
        assert rc == 1 and "no ckpt home at" in err, args
    assert not (tmp_path / "none").exists()


def test_the_list_says_where_credentials_come_from_never_them(home, capsys, monkeypatch):
    ckpt(home, capsys, "add", "s3://bucket-a/p", "--quota", "2TB", "--endpoint", "http://st1:8333", "--no-check")
    rc, out, _ = ckpt(home, capsys, "list")
    assert rc == 0 and "no credentials were found" in out and "2.0 TB" in out
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTESTTESTTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    for args in (["list"], ["list", "--json"]):
        rc, out, _ = ckpt(home, capsys, *args)
        assert "the environment (AWS_ACCESS_KEY_ID" in out
        assert "very-secret-value" not in out and "AKIDTESTTESTTEST" not in out
    assert "very-secret-value" not in (home / "config.toml").read_text()


def test_a_running_ckpt_up_is_told_to_restart_and_the_list_says_it_runs_with_other_targets(home, capsys):
    """`ckpt up` reads config.toml when it starts (its record, effective.toml, is this process's)."""
    effective.write(settings_mod.load({"home": home}, environ={}), {})
    try:
        rc, out, _ = ckpt(home, capsys, "add", "s3://bucket-a", "--no-check")
        assert rc == 0 and f"the running `ckpt up` (pid {os.getpid()})" in out and "once restarted" in out
        rc, out, _ = ckpt(home, capsys, "list")
        assert rc == 0 and "bucket-a" in out
        assert "uses the targets config.toml had when it started (none): restart it" in out
        rc, out, _ = ckpt(home, capsys, "remove", "bucket-a")
        assert rc == 0 and "it uses this target until it is restarted" in out
    finally:
        effective.remove(home)
    rc, out, _ = ckpt(home, capsys, "add", "s3://bucket-a", "--no-check")
    assert "`ckpt up` uses it from its next start" in out
