"""URLs as people see them (pipeline/masking.py): the password never shows, whatever it holds
and however the URL spells it; a URL without one is left exactly as it is."""
from __future__ import annotations

from urllib.parse import quote

import pytest

from pipeline import effective
from pipeline.cli.config_cmd import shown
from pipeline.errors import ConfigError
from pipeline.masking import masked_url
from pipeline.settings import load

#: Each character a hand-written parser takes for the end of the password (or of the URL).
PASSWORD = "p#a/s?s@w:rd"
PIECES = ("p#a", "s?s", "w:rd", "a/s", "%23", "%2F", "%3F", "%40", "%3A")

MASKED = [
    ("postgresql+psycopg://ckpt:{}@db.lan:5432/ckpt", "postgresql+psycopg://ckpt:***@db.lan:5432/ckpt"),
    ("redis://:{}@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
    ("rediss://default:{}@cache.lan:6380/1?ssl_cert_reqs=none", "rediss://default:***@cache.lan:6380/1?ssl_cert_reqs=none"),
    ("unix:///run/redis.sock?db=0&password={}", "unix:///run/redis.sock?db=0&password=***"),
    ("unix://:{}@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ("postgresql+psycopg://ckpt@db.lan/ckpt?sslpassword={}&sslmode=require",
     "postgresql+psycopg://ckpt@db.lan/ckpt?sslpassword=***&sslmode=require"),
]


@pytest.mark.parametrize("spelled", ["raw", "percent-encoded"])
@pytest.mark.parametrize(("template", "expected"), MASKED)
def test_a_password_with_url_delimiters_never_shows(template, expected, spelled):
    url = template.format(PASSWORD if spelled == "raw" else quote(PASSWORD, safe=""))
    shown_url = masked_url(url)
    assert shown_url == expected
    assert not any(piece in shown_url for piece in PIECES), shown_url


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://u:p@[fe80::1]:6379", "redis://u:***@[fe80::1]:6379"),
    ("postgresql://user@azure-srv:pw@db.lan/ckpt", "postgresql://user@azure-srv:***@db.lan/ckpt"),  # "@" in the user
    ("redis://:p@ss/x@h:6379/0", "redis://:***@h:6379/0"),
    ("mysql+pymysql://u:pw@h/db", "mysql+pymysql://u:***@h/db"),
    ("weird-scheme.x://u:pw@h/x", "weird-scheme.x://u:***@h/x"),  # not a URL SQLAlchemy parses
    # No "@" a host can follow: which part is password cannot be told, so none is shown.
    (f"redis://h:6379/0?password={PASSWORD}", "redis://***"),
])
def test_an_ambiguous_url_shows_too_little_never_a_piece_of_the_password(url, expected):
    assert masked_url(url) == expected


@pytest.mark.parametrize("url", [
    "sqlite:////home/a/.ckpt/ckpt.db", "sqlite:////home/a@b/ckpt.db", "unix:///x/redis.sock",
    "postgresql+psycopg://ckpt@db.lan:5432/ckpt", "redis://cache.lan:6379/0?db=1&x=a%40b",
    "https://hooks.example.com/services/T0/B0/tok", "not a url",
])
def test_a_url_without_a_password_is_left_exactly_as_it_is(url):
    assert masked_url(url) == url


def test_ckpt_config_and_the_record_show_a_raw_password_masked(tmp_path):
    """SQLAlchemy takes a password up to its "@": "#", "/" and "?" may stay unencoded there."""
    raw = PASSWORD.replace("@", ":")
    url = f"postgresql+psycopg://ckpt:{raw}@db.lan:5432/ckpt"
    s = load({"home": tmp_path, "database_url": url}, environ={})
    assert s.database_url == url
    assert shown(s, "database_url") == "postgresql+psycopg://ckpt:***@db.lan:5432/ckpt"
    text = effective.write(s, {}).read_text()
    assert "postgresql+psycopg://ckpt:***@db.lan:5432/ckpt" in text
    assert not any(piece in text for piece in (*PIECES, "s:rd")), text


@pytest.mark.parametrize(("name", "url", "codes"), [
    ("database_url", f"postgresql+psycopg://ckpt:{PASSWORD}@db.lan:5432/ckpt", "@ as %40"),
    ("redis_url", f"redis://:{PASSWORD}@10.0.0.5:6379/0", "@ as %40, / as %2F, ? as %3F, # as %23"),
])
def test_a_password_its_driver_would_cut_short_is_refused_masked(tmp_path, name, url, codes):
    """Unencoded, "p#a/s?s@w:rd" is read by psycopg as host "w:rd@db.lan" and by redis-py as
    port "p": both show that piece in their errors."""
    with pytest.raises(ConfigError) as caught:
        load({"home": tmp_path, name: url}, environ={})
    assert str(caught.value).startswith(f"{name} {masked_url(url)}: percent-encode {codes} in its password")
    assert not any(piece in str(caught.value) for piece in ("p#a", "s?s", "w:rd", "a/s")), caught.value
    encoded = url.replace(PASSWORD, quote(PASSWORD, safe=""))
    assert getattr(load({"home": tmp_path, name: encoded}, environ={}), name) == encoded


def test_a_storage_worker_url_with_a_password_is_refused(tmp_path):
    """Worker URLs are shown as they are (logs, status, UI): none may carry a secret."""
    with pytest.raises(ConfigError, match=r"workers: http://u:\*\*\*@st1:7100 holds a password"):
        load({"home": tmp_path, "workers": ("http://st0:7100", f"http://u:{quote(PASSWORD, safe='')}@st1:7100")},
             environ={})
    assert load({"home": tmp_path, "workers": ("http://st0:7100",)}, environ={}).workers == ("http://st0:7100",)
