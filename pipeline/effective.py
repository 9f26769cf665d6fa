"""The settings a running ``ckpt up`` runs with, recorded in ``<home>/effective.toml``.

``ckpt up`` writes the record once its services are ready and removes it when it stops; every
other command of the home loads it as a layer (pipeline/settings.py: flag > this command's
``CKPT_*`` env > this record > config.toml > default), so ``ckpt status``, ``ckpt gc`` and
``ckpt policy`` in another shell see the values the running services use. The file is this
user's only (0600) and holds no secret: the cluster key, and a database or Redis URL with a
password, are listed masked in ``[masked]``, which is never loaded (a command given no URL of
its own then refuses to run rather than use another control plane: pipeline/settings.py). The
record names the process that wrote it by pid and identity (pipeline/liveness.py): one whose
``ckpt up`` is gone (killed outright, its pid free or now another process's) is ignored, and so
is one written on another machine (a home shared between hosts).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import liveness
from pipeline.durable import write_private
from pipeline.masking import masked_url

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
    #: the writer's pipeline.liveness.identity ("" in a record written before there was one)
    process: str = ""
    #: why it is not applied here ("" when it is)
    ignored: str = ""
    #: it is not applied because its ``ckpt up`` is gone (a record left by a ``kill -9``)
    stale: bool = False


def secret_form(name: str, value: Any) -> str | None:
    """The masked form of a secret value, or None when ``value`` is not secret. A webhook URL's
    path and query are masked too: hooks carry their token there (``/services/T0/B0/XXXX``)."""
    from urllib.parse import urlsplit

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
             f"pid = {os.getpid()}", f"process = {toml_value(liveness.identity())}",
             f"machine = {toml_value(socket.gethostname())}", "", "[settings]"]
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
        pid, machine, process = int(data["pid"]), str(data["machine"]), str(data.get("process", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ignored, why = "", None
    if machine != socket.gethostname():
        ignored = f"written by `ckpt up` on {machine}, not this machine"
    elif (why := liveness.gone(pid, process)) is not None:
        ignored = f"its `ckpt up` (pid {pid}) {why}"
    return Record(dict(data.get("settings", {})), {k: str(v) for k, v in data.get("sources", {}).items()},
                  {k: str(v) for k, v in data.get("masked", {}).items()}, pid, machine, path, process, ignored,
                  stale=why is not None)


def remove(home: Path) -> None:
    """Remove this process's record (not one a later ``ckpt up`` wrote over it)."""
    record = read(home)
    if (record is not None and record.pid == os.getpid() and record.machine == socket.gethostname()
            and record.process == liveness.identity()):
        record.path.unlink(missing_ok=True)


_said: set[tuple[Path, int, str]] = set()


def say_ignored(record: Record) -> None:
    """Log once per process why a record left by a ``ckpt up`` that is gone is not applied."""
    key = (record.path, record.pid, record.process)
    if record.stale and key not in _said:
        _said.add(key)
        logging.getLogger("ckpt.settings").warning(
            "not applying %s: %s; this command uses its own settings (the next `ckpt up` replaces the file)",
            record.path, record.ignored)


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
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
