"""The settings a running ``ckpt up`` runs with, recorded in ``<home>/effective.toml``.

``ckpt up`` writes the record once its services are ready and removes it when it stops; every
other command of the home loads it as a layer (pipeline/settings.py: flag > this command's
``CKPT_*`` env > this record > config.toml > default), so ``ckpt status``, ``ckpt gc`` and
``ckpt policy`` in another shell see the values the running services use. The file is this
user's only (0600) and holds no secret: the cluster key, and a database or Redis URL with a
password, are listed masked in ``[masked]``, which is never loaded. A record whose ``ckpt up``
is gone (killed outright: its pid is dead on this machine) is ignored; one written on another
machine (a home shared between hosts) is not applied there either.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.durable import write_private

if TYPE_CHECKING:
    from pipeline.settings import Settings

NAME = "effective.toml"
#: Never recorded: where the record is, and what only ``ckpt up``'s own children use.
NOT_RECORDED = ("home", "ready_dir")


@dataclass(frozen=True)
class Record:
    values: dict[str, Any]
    sources: dict[str, str]
    masked: dict[str, str]
    pid: int
    machine: str
    path: Path
    #: why it is not applied here ("" when it is)
    ignored: str = ""


def secret_form(name: str, value: Any) -> str | None:
    """The masked form of a secret value, or None when ``value`` is not secret. A webhook URL's
    path and query are masked too: hooks carry their token there (``/services/T0/B0/XXXX``)."""
    from urllib.parse import urlsplit

    from pipeline.settings import masked_url

    if name == "cluster_key":
        return "***" if value else None
    if name == "alert_webhook" and value:
        parts = urlsplit(masked_url(str(value)))
        hidden = f"{parts.scheme}://{parts.netloc}" + ("/***" if parts.path.strip("/") or parts.query else "")
        return hidden if hidden != str(value) else None
    if name in ("database_url", "redis_url") and value and masked_url(str(value)) != str(value):
        return masked_url(str(value))
    return None


def write(settings: Settings, sources: dict[str, str]) -> Path:
    """Record ``settings`` (with where each value came from) in ``<home>/effective.toml``."""
    values, masked = {}, {}
    for f in dataclasses.fields(settings):
        if f.name in NOT_RECORDED:
            continue
        value = getattr(settings, f.name)
        hidden = secret_form(f.name, value)
        if hidden is not None:
            masked[f.name] = hidden
        elif _encodable(toml_value(value)):  # a path that is not UTF-8 is left to each command's own layers
            values[f.name] = value
    lines = ["# The settings the running `ckpt up` uses (written by it; removed when it stops).",
             "# Later commands of this home load them under their own flags and CKPT_* env.",
             "# `ckpt config` shows each value and where it came from.",
             f"pid = {os.getpid()}", f"machine = {toml_value(socket.gethostname())}", "", "[settings]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    lines += ["", "[sources]"] + [f"{k} = {toml_value(sources.get(k, 'default'))}" for k in values]
    lines += ["", "# secrets: shown masked, never loaded", "[masked]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in masked.items()]
    path = settings.home / NAME
    write_private(path, "\n".join(lines) + "\n")
    return path


def read(home: Path) -> Record | None:
    """The record of ``home``'s ``ckpt up``, or None when there is none (or it is unreadable)."""
    path = home / NAME
    try:
        data = tomllib.loads(path.read_text())
        pid, machine = int(data["pid"]), str(data["machine"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ignored = ""
    if machine != socket.gethostname():
        ignored = f"written by `ckpt up` on {machine}, not this machine"
    elif not _alive(pid):
        ignored = f"its `ckpt up` (pid {pid}) is gone"
    return Record(dict(data.get("settings", {})), {k: str(v) for k, v in data.get("sources", {}).items()},
                  {k: str(v) for k, v in data.get("masked", {}).items()}, pid, machine, path, ignored)


def remove(home: Path) -> None:
    """Remove this process's record (not one a later ``ckpt up`` wrote over it)."""
    record = read(home)
    if record is not None and record.pid == os.getpid() and record.machine == socket.gethostname():
        record.path.unlink(missing_ok=True)


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def toml_value(value: Any) -> str:
    """``value`` (str, int, float or a tuple of str) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    # A JSON string is a TOML basic string but for DEL, which TOML wants escaped too.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
