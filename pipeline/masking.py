"""A URL as people may see it: its password replaced by ``***``.

Every place a database, Redis or webhook URL reaches a log line, a message, ``ckpt config``,
``ckpt up``'s banner or ``<home>/effective.toml`` shows it through :func:`masked_url`. A
password should be percent-encoded, but one often is not (``p#a/s?s@w:rd``), and then the
URL is ambiguous: the ``@`` that ends the credentials is taken to be the last one after which a
host (and port) can follow, so that a doubtful reading shows too little, never a piece of the
password; when a host can follow none, nothing but the scheme is shown. A URL with a single
``@`` is read by SQLAlchemy (``make_url``), which takes the password up to it whatever it holds.
``password=`` (and any ``*pass*``, ``*secret*``, ``*token*``) query parameters are masked too:
redis-py reads ``unix:///r.sock?password=...``.
"""
from __future__ import annotations

import re

#: What may follow the ``@`` that ends the credentials: a host (a bracketed IPv6 address or a
#: name without ``@``), a numeric port, then nothing or a path or a query.
_AFTER_CREDENTIALS = re.compile(r"(?:\[[^\]/?#@]*\]|[^/?#@:\[\]]*)(?::\d*)?(?:[/?#].*)?", re.S)
#: A query parameter holding a secret, and its value up to the next ``&`` or ``;``.
_SECRET_PARAMETER = re.compile(r"(?i)(^|[&;])([^=&;]*(?:pass|secret|token)[^=&;]*)=[^&;]*")


def masked_url(url: str) -> str:
    """``url`` with its password (in its user part or a query parameter) replaced by ``***``;
    ``url`` itself, unchanged, when it holds none (so ``masked_url(u) != u`` says ``u`` has one)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    at = _credentials_end(rest)
    if at is None:  # no reading is safe to show
        return f"{scheme}://***"
    user, place = (rest[:at], rest[at + 1:]) if at >= 0 else ("", rest)
    shown_place = _masked_query(place)
    if ":" not in user:  # no password in the user part
        return url if shown_place == place else f"{scheme}://{rest[:at + 1]}{shown_place}"
    rendered = _rendered(url) if rest.count("@") == 1 else None
    if rendered is not None:
        head, _, tail = rendered.rpartition("@")
        return f"{head}@{_masked_query(tail)}"
    return f"{scheme}://{user.split(':', 1)[0]}:***@{shown_place}"


def raw_in_password(url: str) -> str:
    """The characters of ``@/?#`` that ``url``'s password (in its user part) holds unencoded:
    a driver that splits the URL at them reads a piece of the password as the host, port or
    path, and shows it in its errors."""
    rest = url.partition("://")[2]
    at = _credentials_end(rest)
    user = rest if at is None else rest[:max(at, 0)]
    password = user.partition(":")[2]
    return "".join(ch for ch in "@/?#" if ch in password)


def _credentials_end(rest: str) -> int | None:
    """Where the ``@`` that ends the credentials of ``rest`` (a URL after ``scheme://``) is:
    the last ``@`` a host can follow; -1 when it has no ``@``; None when no ``@`` can be the
    one (what follows each could be a piece of a password)."""
    if rest.startswith("/") or "@" not in rest:  # unix:///path: no user part
        return -1
    ats = [i for i, ch in enumerate(rest) if ch == "@"]
    for i in reversed(ats):
        if _AFTER_CREDENTIALS.fullmatch(rest, i + 1):
            return i
    return None


def _rendered(url: str) -> str | None:
    """SQLAlchemy's rendering of ``url`` with the password hidden, or None when it does not
    parse as SQLAlchemy reads URLs (then :func:`masked_url` splits it itself)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None
    if parsed.password is None or "@" in (parsed.host or ""):
        return None
    return parsed.render_as_string(hide_password=True)


def _masked_query(place: str) -> str:
    """``place`` (host, path, query) with the values of secret query parameters masked."""
    where, sep, query = place.partition("?")
    if not sep:
        return place
    return f"{where}?{_SECRET_PARAMETER.sub(lambda m: f'{m.group(1)}{m.group(2)}=***', query)}"
