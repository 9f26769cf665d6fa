"""Object-store targets: ``[[targets]]`` in config.toml parsed and validated with clear errors,
no credential ever accepted there; content-addressed keys and S3's checksums (pure)."""
from __future__ import annotations

import hashlib

import pytest

from pipeline import effective
from pipeline.errors import ConfigError
from pipeline.objectstore import keys
from pipeline.objectstore.config import from_json, parse_targets, to_json
from pipeline.settings import explain, load

CONFIG = '''
rf = 2

[[targets]]
name = "archive"
url = "s3://ckpt-archive/team-a/runs/"
endpoint = "http://127.0.0.1:8333"
region = "eu-west-1"
profile = "ckpt"
addressing_style = "path"
sse = "aws:kms"
sse_kms_key_id = "alias/ckpt"
quota_bytes = 10_000_000_000_000

[[targets]]
name = "r2"
url = "s3://other"
'''


def test_targets_in_config_toml_become_settings_and_reach_a_later_command(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    (home / "config.toml").write_text(CONFIG)
    s, sources = explain({"home": home}, environ={})
    a, b = s.object_targets()
    assert (a.name, a.bucket, a.prefix, a.endpoint, a.region, a.profile) == (
        "archive", "ckpt-archive", "team-a/runs", "http://127.0.0.1:8333", "eu-west-1", "ckpt")
    assert (a.addressing_style, a.sse, a.sse_kms_key_id, a.quota_bytes) == ("path", "aws:kms", "alias/ckpt", 10**13)
    assert (b.name, b.bucket, b.prefix, b.endpoint, b.addressing_style) == ("r2", "other", "", "", "auto")
    assert sources["targets"] == "config.toml"
    effective.write(s, sources)  # what `ckpt up` records: the same targets for `ckpt status` elsewhere
    (home / "config.toml").write_text("rf = 2\n")
    assert load({"home": home}, environ={}).object_targets() == [a, b]
    assert from_json(to_json([a, b])) == [a, b]


def test_a_target_given_through_the_environment_is_validated(tmp_path):
    env = {"CKPT_TARGETS": '[{"name": "x", "url": "s3://Bad_Bucket"}]'}
    with pytest.raises(ConfigError, match="'Bad_Bucket' is not a valid bucket name"):
        load({"home": tmp_path}, environ=env)


@pytest.mark.parametrize("table,needle", [
    ({"name": "a", "url": "s3://bkt", "aws_secret_access_key": "S3CR3T"},
     "aws_secret_access_key: credentials are never read from the configuration"),
    ({"name": "a", "url": "s3://bkt", "access_key": "AKIA"}, "give them through the environment"),
    ({"name": "a"}, r"targets\[0\] \(a\): url \(s3://bucket/prefix\) is required"),
    ({"name": "a", "url": "https://bkt/x"}, "url must look like s3://bucket/prefix"),
    ({"name": "a", "url": "s3://bk"}, "'bk' is not a valid bucket name"),
    ({"name": "a", "url": "s3://bkt/a//b"}, "empty component"),
    ({"name": "a b", "url": "s3://bkt"}, "name must be"),
    ({"name": "a", "url": "s3://bkt", "endpoint": "127.0.0.1:9000"}, r"endpoint must be http\(s\)://host"),
    ({"name": "a", "url": "s3://bkt", "endpoint": "http://u:p@host:9000"}, "no path or user"),
    ({"name": "a", "url": "s3://bkt", "addressing_style": "dns"}, "addressing_style must be one of auto, path"),
    ({"name": "a", "url": "s3://bkt", "sse": "on"}, "sse must be empty, AES256 or aws:kms"),
    ({"name": "a", "url": "s3://bkt", "sse_kms_key_id": "k"}, "sse_kms_key_id needs sse"),
    ({"name": "a", "url": "s3://bkt", "quota_bytes": -1}, "quota_bytes must be >= 0"),
    ({"name": "a", "url": "s3://bkt", "quota_bytes": "lots"}, "quota_bytes: 'lots' is not a valid int"),
    ({"name": "a", "url": "s3://bkt", "quota_bytes": 1.5}, "quota_bytes: 1.5 is not a valid int"),
    ({"name": "a", "url": "s3://bkt", "part_size": 1024}, "part_size must be between 5 MiB and 5 GiB"),
    ({"name": "a", "url": "s3://bkt", "region": 3}, "region: 3 is not a valid str"),
    ({"name": "a", "url": "s3://bkt", "bucket": "x"}, "unknown option 'bucket'"),
    ({"name": "a", "url": "s3://bkt", "endpoint_url": "x"}, "unknown option 'endpoint_url' .known: name, url, "),
])
def test_a_bad_target_is_refused_with_what_and_where(tmp_path, table, needle):
    home = tmp_path / "h"
    home.mkdir()
    with pytest.raises(ConfigError, match=needle) as e:
        parse_targets([table], str(home / "config.toml"))
    assert "S3CR3T" not in str(e.value) and "AKIA" not in str(e.value)


def test_target_names_are_unique_and_targets_an_array_of_tables(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    (home / "config.toml").write_text('[[targets]]\nname = "a"\nurl = "s3://bkt"\n'
                                      '[[targets]]\nname = "a"\nurl = "s3://bkt2"\n')
    with pytest.raises(ConfigError, match="two targets are named 'a'"):
        load({"home": home}, environ={})
    (home / "config.toml").write_text('[targets]\nname = "a"\n')
    with pytest.raises(ConfigError, match=r"targets must be an array of tables \(\[\[targets\]\]\)"):
        load({"home": home}, environ={})


def test_keys_are_content_addressed_under_the_prefix_and_read_back():
    sha = hashlib.sha256(b"x").hexdigest()
    assert keys.key_for("team/a", sha) == f"team/a/{sha[:2]}/{sha}"
    assert keys.key_for("", sha) == f"{sha[:2]}/{sha}"
    assert keys.sha_of("team/a", keys.key_for("team/a", sha)) == sha
    assert keys.sha_of("", keys.key_for("", sha)) == sha
    assert keys.sha_of("team/a", f"team/ab/{sha[:2]}/{sha}") is None  # another prefix
    assert keys.sha_of("team/a", f"team/a/zz/{sha}") is None  # not its fan-out directory
    assert keys.sha_of("team/a", "team/a/readme") is None
    with pytest.raises(ValueError):
        keys.key_for("p", sha.upper())


def test_checksums_single_put_and_composite():
    sha = hashlib.sha256(b"abc").hexdigest()
    assert keys.full_checksum(sha) == "ungWv48Bz+pBQUDeXa4iI7ADYaOWF3qctBD/YfIAFa0="
    parts = [hashlib.sha256(b"a").digest(), hashlib.sha256(b"bc").digest()]
    c = keys.composite(parts)
    assert c == keys.b64(hashlib.sha256(parts[0] + parts[1]).digest()) + "-2"
    assert keys.is_composite(c) and not keys.is_composite(keys.full_checksum(sha))


def test_part_size_grows_so_an_object_fits_in_ten_thousand_parts():
    mib = 2**20
    assert keys.part_size_for(1024 * mib, 16 * mib) == 16 * mib
    big = 1024 * 1024 * mib  # 1 TiB
    p = keys.part_size_for(big, 16 * mib)
    assert p % mib == 0 and -(-big // p) <= keys.MAX_PARTS and p - mib < big / keys.MAX_PARTS
    assert keys.ranges(10, 4) == [(0, 4), (4, 4), (8, 2)] and keys.ranges(0, 4) == [(0, 0)]


def test_a_read_back_throttle_keeps_the_average_rate_under_its_limit():
    from pipeline.objectstore.download import Throttle

    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    t = Throttle(1000.0, clock=lambda: now[0], sleep=sleep)
    t.take(500)  # 0.5 s of budget used at once: wait it out
    assert slept == [0.5]
    now[0] += 2.0  # a slow read: the budget it left is not made up by sleeping
    t.take(500)
    assert slept == [0.5]
    t.take(3000)  # 4000 bytes by 102.5 s: 4 s of budget, 2.5 s elapsed
    assert slept == [0.5, 1.5] and t.bytes / (now[0] - 100.0) <= 1000.0
    free = Throttle(0, clock=lambda: now[0], sleep=sleep)
    free.take(10**9)
    assert len(slept) == 2  # 0: unthrottled
