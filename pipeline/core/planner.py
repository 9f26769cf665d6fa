"""The shard planner: a pure function from a file's layout to its shard manifest.

Algorithm. An opaque file is cut into fixed ``target``-byte chunks. A safetensors file
becomes one raw shard holding its own header bytes (so the file can be rebuilt exactly),
then shards of whole tensors, each itself a valid safetensors file.

Cuts follow module boundaries, so that what training leaves unchanged keeps its shards.
Tensors are grouped into *units*: consecutive tensors of one numbered block
(``model.layers.7.*``) or of one module (``lm_head.*``). A unit of at least ``target / 8``
bytes never shares a shard with another unit; if it is larger than ``target`` it is split
into ``ceil(size / target)`` byte-balanced groups of its tensors. Runs of smaller units
are packed together the same byte-balanced way, cutting only between units. A step that
freezes some blocks (fine-tuning the top of a network, say) then changes only the shards
of the blocks it trained. A single tensor larger than ``target`` gets a shard of its own
rather than being split.

Edge cases: an empty file gives one empty raw shard; a safetensors file without tensors
gives only its header shard. Cuts depend only on the layout (names, dtypes, shapes),
never on tensor values, so a later checkpoint with the same layout is cut at the same
places and its unchanged shards keep their SHA-256 (and are not sent again).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pipeline.core.header import Header, TensorInfo, shard_header


@dataclass(frozen=True)
class ShardPlan:
    seq: int
    #: "raw": bytes ``[src_offset, src_offset + length)`` of the file;
    #: "safetensors": ``header`` followed by that byte range.
    kind: str
    src_offset: int
    length: int
    header: bytes = b""
    tensors: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return len(self.header) + self.length

    @property
    def payload_offset(self) -> int:
        return len(self.header)


def plan(header: Header | None, size: int, target: int) -> list[ShardPlan]:
    """The shards of a file of ``size`` bytes: by tensors if it is safetensors (``header``),
    in fixed chunks otherwise."""
    return plan_safetensors(header, target) if header is not None else plan_opaque(size, target)


def plan_opaque(size: int, target: int) -> list[ShardPlan]:
    """Fixed-size chunks of an opaque file of ``size`` bytes."""
    if target <= 0:
        raise ValueError("target must be positive")
    if size == 0:
        return [ShardPlan(seq=0, kind="raw", src_offset=0, length=0)]
    return [
        ShardPlan(seq=i, kind="raw", src_offset=off, length=min(target, size - off))
        for i, off in enumerate(range(0, size, target))
    ]


def plan_safetensors(header: Header, target: int) -> list[ShardPlan]:
    """Header shard plus byte-balanced groups of whole tensors."""
    if target <= 0:
        raise ValueError("target must be positive")
    plans = [ShardPlan(seq=0, kind="raw", src_offset=0, length=header.data_start)]
    for group in group_tensors(header.tensors, target):
        plans.append(
            ShardPlan(
                seq=len(plans),
                kind="safetensors",
                src_offset=header.data_start + group[0].begin,
                length=group[-1].end - group[0].begin,
                header=shard_header(group),
                tensors=tuple(t.name for t in group),
            )
        )
    return plans


def group_tensors(tensors: tuple[TensorInfo, ...], target: int) -> list[tuple[TensorInfo, ...]]:
    """Split offset-sorted ``tensors`` into contiguous groups along module boundaries."""
    groups: list[tuple[TensorInfo, ...]] = []
    small: list[tuple[TensorInfo, ...]] = []  # consecutive units smaller than target / 8
    for unit in module_units(tensors):
        size = unit[-1].end - unit[0].begin
        if size and 8 * size >= target:
            groups += _balanced(small, target) + _balanced([(t,) for t in unit], target)
            small = []
        else:
            small.append(unit)
    return groups + _balanced(small, target)


def module_key(name: str) -> str:
    """The block or module a tensor belongs to: ``model.layers.7`` for
    ``model.layers.7.mlp.up_proj.weight``, ``lm_head`` for ``lm_head.weight``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def module_units(tensors: tuple[TensorInfo, ...]) -> list[tuple[TensorInfo, ...]]:
    """Maximal runs of consecutive tensors with the same :func:`module_key`."""
    units: list[list[TensorInfo]] = []
    last = None
    for t in tensors:
        key = module_key(t.name)
        if units and key == last:
            units[-1].append(t)
        else:
            units.append([t])
        last = key
    return [tuple(u) for u in units]


def _balanced(pieces: list[tuple[TensorInfo, ...]], target: int) -> list[tuple[TensorInfo, ...]]:
    """Join consecutive ``pieces`` into ``ceil(bytes / target)`` groups, cutting only between
    pieces: the ``k``-th cut is the piece boundary nearest to ``k / n`` of the bytes."""
    if not pieces:
        return []
    start = pieces[0][0].begin
    total = pieces[-1][-1].end - start
    n = max(1, math.ceil(total / target))
    ends = [p[-1].end - start for p in pieces]  # boundary after piece i
    cuts: list[int] = []  # indices i: a group ends after piece i
    lo = 0
    for k in range(1, n):
        ideal = k * total / n
        j = bisect.bisect_left(ends, ideal, lo)
        best = None
        for cand in (j - 1, j):
            if lo <= cand < len(pieces) - 1 and (best is None or abs(ends[cand] - ideal) < abs(ends[best] - ideal)):
                best = cand
        if best is None:
            continue
        cuts.append(best)
        lo = best + 1
    groups, first = [], 0
    for c in cuts + [len(pieces) - 1]:
        group = tuple(t for p in pieces[first : c + 1] for t in p)
        if group:
            groups.append(group)
        first = c + 1
    return groups
