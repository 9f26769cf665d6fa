"""The shard planner: a pure function from a file's layout to its shard manifest.

Algorithm. An opaque file is cut into fixed ``target``-byte chunks. A safetensors file
becomes one raw shard holding its own header bytes (so the file can be rebuilt exactly),
then ``n = ceil(data_len / target)`` shards of whole tensors: the ``k``-th cut is the
tensor boundary nearest to ``k * data_len / n``, so shards are byte-balanced and each
is itself a valid safetensors file. A tensor larger than ``target`` gets a shard of its
own rather than being split.

Edge cases: an empty file gives one empty raw shard; a safetensors file without tensors
gives only its header shard. Cuts depend only on the layout (names, dtypes, shapes),
never on tensor values, so a later checkpoint with the same layout is cut at the same
places and its unchanged shards keep their SHA-256 (and are not sent again).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pipeline.header import Header, TensorInfo, shard_header


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
    """Split offset-sorted ``tensors`` into contiguous, byte-balanced groups."""
    if not tensors:
        return []
    total = tensors[-1].end
    n = max(1, math.ceil(total / target))
    ends = [t.end for t in tensors]  # boundary after tensor i
    cuts: list[int] = []  # indices i: a group ends after tensor i
    lo = 0
    for k in range(1, n):
        ideal = k * total / n
        j = bisect.bisect_left(ends, ideal, lo)
        best = None
        for cand in (j - 1, j):
            if lo <= cand < len(tensors) - 1 and (best is None or abs(ends[cand] - ideal) < abs(ends[best] - ideal)):
                best = cand
        if best is None:
            continue
        cuts.append(best)
        lo = best + 1
    groups, start = [], 0
    for c in cuts:
        groups.append(tuple(tensors[start : c + 1]))
        start = c + 1
    groups.append(tuple(tensors[start:]))
    return [g for g in groups if g]
