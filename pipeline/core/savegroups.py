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
#: Its index: ``<stem><ext>.index.json``, or with a variant (``save_pretrained(...,
#: variant="fp16")``: shards ``model.fp16-00001-of-00002.safetensors``) ``<stem><ext>.index.<variant>.json``.
_INDEX_NAME = re.compile(r"^(?P<stem>.+?)(?P<ext>\.[A-Za-z0-9]+)\.index(?:\.(?P<variant>[A-Za-z0-9_-]+))?\.json$")


def save_group(name: str) -> str:
    """For a file directly in a run, the save it is one file of, when a writer saves several
    side by side (``save_pretrained(run, max_shard_size=...)``: ``model-00001-of-00005.safetensors``
    ... and ``model.safetensors.index.json``): ``"model.safetensors"`` (with a variant:
    ``"model.fp16.safetensors"``); else ``""``."""
    m = SHARD_NAME.match(name)
    if m:
        return f"{m['stem']}{m['ext']}"
    m = _INDEX_NAME.match(name)
    if not m:
        return ""
    return f"{m['stem']}.{m['variant']}{m['ext']}" if m["variant"] else f"{m['stem']}{m['ext']}"


def is_index(name: str) -> bool:
    return _INDEX_NAME.match(name) is not None


def index_names(group: str) -> list[str]:
    """The names the index of save group ``group`` may have: ``model.fp16.safetensors``'s is
    ``model.fp16.safetensors.index.json``, or, for the variant ``fp16`` of
    ``model.safetensors``, ``model.safetensors.index.fp16.json``."""
    stem, dot, ext = group.rpartition(".")
    names = [f"{group}.index.json"]
    base, vdot, variant = stem.rpartition(".")
    if dot and vdot:
        names.append(f"{base}.{ext}.index.{variant}.json")
    return names


def whole_save(group: str, written: Mapping[str, float]) -> list[str] | None:
    """Of ``written`` (name -> when its file was written: the recorded current files of save
    group ``group`` in one folder, of one host), the names of the save its index completes, the
    index first: the index and the shards it names, which are the set of one count ``N``
    written last before it (its writer writes the index after them; a set written after the
    index is a later save not complete yet, one before it an earlier save's left beside).
    None without the index, or when that set lacks a shard. The times are the files' own (an
    index saved again byte for byte is written again with its shards), not when their content
    was first complete."""
    indexes = [n for n in written if is_index(n) and save_group(n) == group]
    if len(indexes) != 1:
        return None
    (index,) = indexes
    sets: dict[int, dict[int, str]] = {}
    for name in written:
        m = SHARD_NAME.match(name)
        if m and f"{m['stem']}{m['ext']}" == group:
            sets.setdefault(int(m["n"]), {})[int(m["k"])] = name
    last = {n: max(written[name] for name in shards.values()) for n, shards in sets.items()}
    before = [n for n in sets if last[n] <= written[index]]
    if not before:
        return None
    n = max(before, key=lambda n: (last[n], n))
    if set(sets[n]) != set(range(1, n + 1)):
        return None
    return [index, *(sets[n][k] for k in sorted(sets[n]))]
