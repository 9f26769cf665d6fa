"""Object-store targets as configured: ``[[targets]]`` tables in config.toml.

::

    [[targets]]
    name = "archive"
    url = "s3://ckpt-archive/team-a"      # bucket, then an optional key prefix
    endpoint = "http://127.0.0.1:8333"    # empty: AWS S3 itself
    region = "us-east-1"                  # empty: the profile's or the environment's
    profile = "ckpt"                      # empty: the default credential chain
    addressing_style = "path"             # auto, path or virtual
    sse = "aws:kms"                       # empty, AES256 or aws:kms (sse_kms_key_id optional)
    quota_bytes = 10_000_000_000_000      # 0: no quota

Credentials come only from the standard AWS sources (the environment, a profile of the shared
files, an instance or container role): a table that holds a key is refused, so no secret is ever
in config.toml, ``effective.toml``, the database or ``up.json`` (docs/design.md, "Object-store
targets"). Parsing is pure: no boto3 here.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import ConfigError

MiB = 1024 * 1024

#: Keys that would put a secret in the configuration: refused, with where credentials go instead.
SECRET_KEYS = frozenset({"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "access_key",
                         "secret_key", "access_key_id", "secret_access_key", "session_token", "password"})
ADDRESSING = ("auto", "path", "virtual")
SSE = ("", "AES256", "aws:kms")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
#: S3's bucket naming rules (a dotted name is valid but needs path addressing with TLS).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class Target:
    """One S3-compatible bucket (and key prefix) that holds copies, and how to talk to it."""

    name: str
    bucket: str
    prefix: str = ""
    endpoint: str = ""
    region: str = ""
    profile: str = ""
    addressing_style: str = "auto"
    sse: str = ""
    sse_kms_key_id: str = ""
    quota_bytes: int = 0
    #: A source larger than this is sent as a multipart upload (resumable), else in one PUT.
    multipart_threshold: int = 64 * MiB
    #: Size of each part of a multipart upload and of each ranged GET (raised as needed so that
    #: an object has at most 10,000 parts, S3's limit), and parts (and ranges) in flight at once:
    #: boto3's transfer defaults, measured as good here (bench/s3.py; 16 MiB parts were slower).
    part_size: int = 8 * MiB
    concurrency: int = 10
    #: Attempts per request, backoff between them (botocore's standard mode: 503 SlowDown and
    #: other throttling from 1 s, 5xx and broken connections from 50 ms, capped at 20 s).
    max_attempts: int = 5
    connect_timeout: float = 10.0
    read_timeout: float = 60.0

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


#: A target's storage row is ``target:<name>`` (pipeline.objectstore.tier).
PREFIX = "target:"


def row_id(name: str) -> str:
    """The storage row id of target ``name``."""
    return PREFIX + name


_FIELDS = {f.name: f for f in dataclasses.fields(Target)}
_TYPES: dict[str, type] = {"quota_bytes": int, "multipart_threshold": int, "part_size": int, "concurrency": int,
                           "max_attempts": int, "connect_timeout": float, "read_timeout": float}


def parse_url(url: str, where: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without surrounding slashes)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(f"{where}: url must look like s3://bucket/prefix, got {url!r}")
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"{where}: {bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, "
                          "digits, dots and hyphens, starting and ending with a letter or digit)")
    if "//" in prefix:
        raise ConfigError(f"{where}: the key prefix {prefix!r} has an empty component")
    return bucket, prefix


def target_from(table: dict[str, Any], where: str) -> Target:
    """One ``[[targets]]`` table, validated; every mistake named with where it is."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: each [[targets]] entry must be a table")
    secret = sorted(k for k in table if k.lower() in SECRET_KEYS)
    if secret:
        raise ConfigError(f"{where}: {', '.join(secret)}: credentials are never read from the configuration "
                          "(it is copied into effective.toml and logs); give them through the environment "
                          "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), a profile of ~/.aws/credentials "
                          "(profile = \"name\") or an instance role")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: name must be 1-63 letters, digits, '.', '_' or '-', got {name!r}")
    where = f"{where} ({name})"
    if "url" not in table:
        raise ConfigError(f"{where}: url (s3://bucket/prefix) is required")
    values: dict[str, Any] = {"name": name}
    values["bucket"], values["prefix"] = parse_url(str(table["url"]), where)
    for k, v in table.items():
        if k in ("name", "url"):
            continue
        if k not in _FIELDS or k in ("bucket", "prefix"):
            known = ", ".join(["name", "url", *(f for f in _FIELDS if f not in ("name", "bucket", "prefix"))])
            raise ConfigError(f"{where}: unknown option {k!r} (known: {known})")
        kind = _TYPES.get(k, str)
        if (kind is not str and isinstance(v, bool) or kind is str and not isinstance(v, str)
                or kind is int and isinstance(v, float) and not v.is_integer()):
            raise ConfigError(f"{where}: {k}: {v!r} is not a valid {kind.__name__}")
        try:
            values[k] = kind(v)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {k}: {v!r} is not a valid {kind.__name__}") from exc
    t = Target(**values)
    _check(t, where)
    return t


def _check(t: Target, where: str) -> None:
    if t.endpoint:
        e = urlsplit(t.endpoint)
        if e.scheme not in ("http", "https") or not e.hostname or e.path.strip("/") or e.username or e.password:
            raise ConfigError(f"{where}: endpoint must be http(s)://host[:port] with no path or user, "
                              f"got {t.endpoint!r}")
    if t.addressing_style not in ADDRESSING:
        raise ConfigError(f"{where}: addressing_style must be one of {', '.join(ADDRESSING)}, "
                          f"got {t.addressing_style!r}")
    if t.sse not in SSE:
        raise ConfigError(f"{where}: sse must be empty, AES256 or aws:kms, got {t.sse!r}")
    if t.sse_kms_key_id and t.sse != "aws:kms":
        raise ConfigError(f"{where}: sse_kms_key_id needs sse = \"aws:kms\"")
    if t.quota_bytes < 0:
        raise ConfigError(f"{where}: quota_bytes must be >= 0 (0: no quota), got {t.quota_bytes}")
    if t.part_size < 5 * MiB or t.part_size > 5 * 1024 * MiB:
        raise ConfigError(f"{where}: part_size must be between 5 MiB and 5 GiB (S3's limits), got {t.part_size}")
    if t.multipart_threshold < t.part_size:
        raise ConfigError(f"{where}: multipart_threshold ({t.multipart_threshold}) must be at least part_size "
                          f"({t.part_size})")
    if t.concurrency < 1 or t.max_attempts < 1:
        raise ConfigError(f"{where}: concurrency and max_attempts must be at least 1")
    if t.connect_timeout <= 0 or t.read_timeout <= 0:
        raise ConfigError(f"{where}: connect_timeout and read_timeout must be > 0")


def parse_targets(tables: Any, where: str) -> list[Target]:
    """The ``[[targets]]`` array of tables; names unique."""
    if not isinstance(tables, list):
        raise ConfigError(f"{where}: targets must be an array of tables ([[targets]])")
    out = [target_from(t, f"{where}: targets[{i}]") for i, t in enumerate(tables)]
    seen: set[str] = set()
    at: dict[tuple[str, str], str] = {}
    for t in out:
        if t.name in seen:
            raise ConfigError(f"{where}: two targets are named {t.name!r}")
        seen.add(t.name)
        # Keys are content addressed: two targets at one bucket and prefix name the same objects,
        # and the collection of one would delete what the other counts as a copy.
        place = (t.url, t.endpoint.rstrip("/").lower())
        if place in at:
            raise ConfigError(f"{where}: targets {at[place]!r} and {t.name!r} are the same bucket and prefix "
                              f"({t.url}{' at ' + t.endpoint if t.endpoint else ''}): keep one")
        at[place] = t.name
    return out


def to_json(targets: list[Target]) -> str:
    """The form ``Settings.targets`` keeps (and ``CKPT_TARGETS`` takes): a JSON array of tables
    with ``url`` in place of bucket and prefix. It holds no secret."""
    rows = []
    for t in targets:
        row = {k: v for k, v in dataclasses.asdict(t).items() if k not in ("bucket", "prefix")
               and v != _FIELDS[k].default}
        rows.append({"url": t.url, **row})
    return json.dumps(rows, sort_keys=True)


def from_json(text: str, where: str = "targets") -> list[Target]:
    """The targets ``Settings.targets`` holds (empty: none)."""
    if not text:
        return []
    try:
        tables = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    return parse_targets(tables, where)
