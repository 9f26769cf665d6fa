"""Editing ``<home>/config.toml`` as text: append an ``[[array]]`` table, remove one, every other
byte kept.

tomllib reads TOML but writes none, and a file rewritten from its parsed data would lose the
user's comments, order and layout. So a table is appended as text at the end, and removed by
cutting exactly its lines: its header through its last key (comments and blank lines after that
belong to what follows; one blank line before a removed table goes with it when one also
follows, so that an append then a remove gives the file back byte for byte). Every edit is
proven before it is written: the new text must parse to the old data with that one table added
or removed, else it is refused, naming what to edit by hand (an inline ``targets = [...]``
array, a header inside a multi-line string: layouts this line reader does not follow).

Writes replace the file atomically (pipeline/durable.py), keeping its permissions (0600 for a new
file: config.toml may hold a database URL with its password), under an exclusive lock on the
home so that two commands editing at once do not lose each other's change.
"""
from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.durable import replace_file
from pipeline.effective import toml_value
from pipeline.errors import ConfigError
from pipeline.settings import read_config

NAME = "config.toml"
_LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")
_ANY_HEADER = re.compile(r"[ \t]*\[")


def read(path: Path) -> tuple[str, dict[str, Any]]:
    """The text of config.toml and its data ("" and {} when there is no file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return "", {}
    return text, read_config(text, path)


def render(key: str, table: dict[str, Any]) -> str:
    """``table`` as a ``[[key]]`` table (strings, integers and floats)."""
    return f"[[{key}]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items())


def appended(text: str, data: dict[str, Any], key: str, table: dict[str, Any], where: Path) -> str:
    """``text`` with ``table`` appended as the last ``[[key]]`` table, after a blank line."""
    lead = "" if not text else ("\n" if text.endswith("\n") else "\n\n")
    new = text + lead + render(key, table)
    _prove(new, {**data, key: [*data.get(key, []), table]}, where,
           f"add the [[{key}]] table by hand (`{key} = [...]` in the file cannot take one more by appending)")
    return new


def removed(text: str, data: dict[str, Any], key: str, index: int, where: Path) -> str:
    """``text`` without its ``index``-th ``[[key]]`` table (0: the first)."""
    lines = _LINE.findall(text)
    header = re.compile(rf"[ \t]*\[\[[ \t]*{re.escape(key)}[ \t]*\]\][ \t]*(#.*)?\r?\n?")
    starts = [i for i, line in enumerate(lines) if header.fullmatch(line)]
    by_hand = f"remove that table from {where} by hand"
    if len(starts) != len(data.get(key, [])) or not 0 <= index < len(starts):
        raise ConfigError(f"{where}: its {key} are not all [[{key}]] tables, each on its own header line: {by_hand}")
    start = starts[index]
    end = next((i for i in range(start + 1, len(lines)) if _ANY_HEADER.match(lines[i])), len(lines))
    while end > start + 1 and _blank_or_comment(lines[end - 1]):
        end -= 1
    if start > 0 and not lines[start - 1].strip() and (end == len(lines) or not lines[end].strip()):
        start -= 1
    new = "".join(lines[:start] + lines[end:])
    rest = [t for i, t in enumerate(data[key]) if i != index]
    _prove(new, {k: v for k, v in data.items() if k != key} | ({key: rest} if rest else {}), where, by_hand)
    return new


def _blank_or_comment(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")


def _prove(new: str, expected: dict[str, Any], where: Path, by_hand: str) -> None:
    try:
        got = read_config(new, where)
    except ConfigError:
        got = None
    if got != expected:
        raise ConfigError(f"{where}: its layout is not one this command edits safely: {by_hand}")


def write(path: Path, text: str) -> None:
    """Replace config.toml (through a symbolic link, the file it names) with ``text``."""
    real = Path(os.path.realpath(path))
    try:
        mode = real.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600
    replace_file(real, text, mode=mode)


@contextmanager
def locked(home: Path) -> Iterator[None]:
    """Hold the home's edit lock (an exclusive flock on its directory) for a read-modify-write."""
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
