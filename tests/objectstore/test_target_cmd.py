"""``ckpt target add`` checks the bucket against a real S3 server (SeaweedFS on loopback) before
writing anything: good credentials add the target (and leave no probe object behind); a wrong
secret, a missing bucket or a store that is down print the one error that says what to do, exit
2 and leave config.toml as it was. ``ckpt target list --check`` says whether each answers now."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.seaweed import ACCESS_KEY, SECRET_KEY, free_port
from pipeline import settings as settings_mod
from pipeline.cli.main import main
from pipeline.db.engine import session_scope
from pipeline.db.migrate import upgrade
from pipeline.db.models import Content, ContentCopy, StorageWorker
from pipeline.db.transitions import now
from pipeline.objectstore import tier
from tests.objectstore.conftest import raw_client

BEFORE = "# my settings\nrf = 2\n"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("CKPT_TARGETS", raising=False)
    h = tmp_path / "home"
    h.mkdir()
    (h / "config.toml").write_text(BEFORE)
    return h


def add(home: Path, capsys, url: str, endpoint: str, *more: str) -> tuple[int, str, str]:
    rc = main(["--home", str(home), "target", "add", url, "--endpoint", endpoint, "--region", "us-east-1",
               "--addressing-style", "path", *more])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_bucket_that_takes_a_probe_is_added_and_the_probe_is_gone(server, bucket, home, capsys):
    rc, out, err = add(home, capsys, f"s3://{bucket}/ckpt", server.endpoint, "--quota", "1GB")
    assert rc == 0, err
    assert "checked with the credentials from the environment" in out and "confirmed" in out
    [t] = settings_mod.load({"home": home}, environ={}).object_targets()
    assert (t.name, t.bucket, t.prefix, t.endpoint) == (bucket, bucket, "ckpt", server.endpoint)
    assert (home / "config.toml").read_text().startswith(BEFORE)
    assert raw_client(server).list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # the probe was deleted

    rc = main(["--home", str(home), "target", "list", "--check", "--json"])
    [row] = json.loads(capsys.readouterr().out)
    assert rc == 0 and row["answers"] and row["used_bytes"] == 0 and row["quota_bytes"] == 10**9


def test_a_wrong_secret_is_the_credentials_error_and_nothing_is_written(server, bucket, home, capsys, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    rc, out, err = add(home, capsys, f"s3://{bucket}/ckpt", server.endpoint)
    assert rc == 2 and out == ""
    # StoreCredentials: a HeadBucket's 403 has no body to name SignatureDoesNotMatch
    assert "HeadBucket of " + bucket + ": access denied: the credentials were refused" in err
    assert "the credentials came from the environment" in err and "nothing was written" in err
    assert "not-the-secret" not in err
    assert (home / "config.toml").read_text() == BEFORE

    rc = main(["--home", str(home), "target", "add", f"s3://{bucket}/ckpt", "--endpoint", server.endpoint,
               "--addressing-style", "path", "--region", "us-east-1", "--no-check"])
    assert rc == 0
    capsys.readouterr()
    assert main(["--home", str(home), "target", "list", "--check"]) == 2
    assert "does not answer" in capsys.readouterr().out


def test_a_missing_bucket_is_named_and_nothing_is_written(server, aws_env, home, capsys):
    rc, out, err = add(home, capsys, "s3://no-such-bucket/ckpt", server.endpoint)
    assert rc == 2 and "the bucket does not exist; create it or fix the target's url" in err
    assert (home / "config.toml").read_text() == BEFORE


def test_a_store_that_is_down_is_unreachable_and_no_config_toml_is_made(aws_env, home, capsys):
    (home / "config.toml").unlink()
    rc, _, err = add(home, capsys, "s3://bucket-a", f"http://127.0.0.1:{free_port()}")
    assert rc == 2 and "endpoint unreachable" in err
    assert not (home / "config.toml").exists()


def test_a_profile_is_checked_with_its_own_keys_and_only_its_name_is_written(server, bucket, home, capsys, monkeypatch,
                                                                             tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text(f"[ckpt]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    rc, out, err = add(home, capsys, f"s3://{bucket}", server.endpoint, "--profile", "ckpt")
    assert rc == 0, err
    assert "checked with the credentials from ~/.aws/credentials (profile 'ckpt')" in out
    text = (home / "config.toml").read_text()
    assert 'profile = "ckpt"' in text and SECRET_KEY not in text and ACCESS_KEY not in text


def test_remove_is_refused_while_the_target_holds_the_only_good_copy_and_its_row_then_goes_down(
        server, bucket, home, capsys):
    assert add(home, capsys, f"s3://{bucket}/ckpt", server.endpoint)[0] == 0
    settings = settings_mod.configure(settings_mod.load({"home": home}, environ={}))
    upgrade(settings.db_url)
    tier.probe(settings)  # what the scheduler does: the target's row, up
    wid = tier.row_id(bucket)
    t = now()
    with session_scope(settings.db_url) as s:
        assert s.get(StorageWorker, wid).state == "up"
        content = Content(sha256="a" * 64, size=4096)
        s.add(content)
        content.copies.append(ContentCopy(worker_id=wid, state="verified", stored_at=t, verified_at=t, attempts=0))
    before = (home / "config.toml").read_text()

    rc = main(["--home", str(home), "target", "remove", bucket])
    err = capsys.readouterr().err
    assert rc == 1 and f"target {bucket} (up) holds the only good copy of 1 content(s)" in err, err
    assert (home / "config.toml").read_text() == before

    with session_scope(settings.db_url) as s:  # a storage worker now holds a good copy too
        s.add(StorageWorker(id="w0", url="http://127.0.0.1:1", source="static", state="up", last_seen=t))
        s.flush()
        s.add(ContentCopy(sha256="a" * 64, worker_id="w0", state="verified", stored_at=t, verified_at=t, attempts=0))
    assert main(["--home", str(home), "target", "remove", bucket]) == 0
    assert "marks the target down" in capsys.readouterr().out
    after = settings_mod.configure(settings_mod.load({"home": home}, environ={}))
    assert after.object_targets() == []
    tier.probe(after)  # the restarted scheduler's probe: no longer configured
    with session_scope(settings.db_url) as s:
        row = s.get(StorageWorker, wid)
        assert row.state == "down" and "no longer configured" in row.last_error


def test_remove_is_refused_while_a_runs_policy_requires_the_target(server, bucket, home, capsys):
    assert add(home, capsys, f"s3://{bucket}/ckpt", server.endpoint)[0] == 0
    with (home / "config.toml").open("a") as f:
        f.write('\n[runs."/data/llm/*"]\ntarget_mode = "required"\n')
    rc = main(["--home", str(home), "target", "remove", bucket])
    err = capsys.readouterr().err
    assert rc == 1 and '[runs."/data/llm/*"] wants 1 object-store copies (target_mode = required)' in err, err
    assert settings_mod.load({"home": home}, environ={}).object_targets() != []
