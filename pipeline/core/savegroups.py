"""One save written as several files side by side, each a checkpoint of its own
(``save_pretrained(run, max_shard_size=...)`` into the run: ``model-00001-of-00005.safetensors``
... and ``model.safetensors.index.json``, written last): which files are one save, and which
of them make a whole one (docs/design.md, "The newest save"). Names only: read by ``ckpt
status``, which does not load the layout table (pipeline/core/layouts.py)."""
from __future__ import annotations

import re
from collections.abc import Mapping

#: A shard of a sharded save: ``<stem>-<k>-of-<n><ext>``, five digits each.
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})(?P<ext>\.[A-Za-z0-9]+)$")
_INDEX_NAME = re.compile(r"^(?P<base>.+)\.index\.json$")


def save_group(name: str) -> str:
    """For a file directly in a run, the save it is one file of, when a writer saves several
    side by side (``save_pretrained(run, max_shard_size=...)``: ``model-00001-of-00005.safetensors``
    ... and ``model.safetensors.index.json``): ``"model.safetensors"``; else ``""``."""
    m = SHARD_NAME.match(name)
    if m:
        return f"{m['stem']}{m['ext']}"
    m = _INDEX_NAME.match(name)
    return m["base"] if m else ""


def whole_save(group: str, files: Mapping[str, float]) -> list[str] | None:
    """Of ``files`` (name -> completion time: the recorded current files of save group ``group``
    in one folder), the names of the save its index completes, the index first: the index and
    the shards it names, which are the set of one count ``N`` written last before it (its
    writer writes the index after them; a set newer than the index is a later save not yet
    complete, one older an earlier save's left beside). None without the index, or when that
    set lacks a shard."""
    index = f"{group}.index.json"
    if index not in files:
        return None
    sets: dict[int, dict[int, str]] = {}
    for name in files:
        m = SHARD_NAME.match(name)
        if m and f"{m['stem']}{m['ext']}" == group:
            sets.setdefault(int(m["n"]), {})[int(m["k"])] = name
    written = {n: max(files[name] for name in shards.values()) for n, shards in sets.items()}
    before = [n for n in sets if written[n] <= files[index]]
    if not before:
        return None
    n = max(before, key=lambda n: (written[n], n))
    if set(sets[n]) != set(range(1, n + 1)):
        return None
    return [index, *(sets[n][k] for k in sorted(sets[n]))]
