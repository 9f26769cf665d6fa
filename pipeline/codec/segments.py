"""Which bytes of a safetensors file hold which dtype: the segments the codec splits by.

A shard is a byte range of a file (pipeline/core/planner.py); its header says where each
tensor lies and of what dtype. :func:`segments` maps a byte range to ``Segment`` s that cover
it exactly, in order: runs of whole elements of one dtype the codec splits into planes
(bf16, fp16, fp32, pipeline/codec/planes.py), and everything else (the JSON header, tensors
of other dtypes, a partial element where the range cuts one) as bytes. Pure: plain data in,
plain data out.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.codec.planes import DTYPE_LAYOUTS, SHAPES
from pipeline.core.header import Header, parse_header
from pipeline.errors import HeaderError


@dataclass(frozen=True)
class Segment:
    """``length`` bytes from ``offset``: whole elements of ``dtype``, or bytes (``None``)."""

    offset: int
    length: int
    dtype: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def spans(header: Header) -> list[Segment]:
    """The runs of tensors of a dtype the codec splits, in file coordinates (consecutive
    tensors of one dtype are one run: each is whole elements, so the run keeps their phase)."""
    out: list[Segment] = []
    for t in header.tensors:
        if t.dtype not in DTYPE_LAYOUTS or not t.nbytes:
            continue
        begin = header.data_start + t.begin
        last = out[-1] if out else None
        if last is not None and last.dtype == t.dtype and last.end == begin:
            out[-1] = Segment(last.offset, last.length + t.nbytes, t.dtype)
        else:
            out.append(Segment(begin, t.nbytes, t.dtype))
    return out


def clip(typed: Sequence[Segment], start: int, length: int) -> list[Segment]:
    """The segments of bytes ``[start, start + length)``, relative to ``start``: the parts of
    ``typed`` (sorted, not overlapping) that hold whole elements, and bytes between them. An
    element the range cuts is bytes, so each typed segment starts on an element boundary."""
    end = start + length
    out: list[Segment] = []
    at = start
    first = bisect.bisect_right([s.end for s in typed], start)
    for s in typed[first:]:
        if s.offset >= end:
            break
        w = SHAPES[DTYPE_LAYOUTS[s.dtype or ""]].width
        lo = s.offset + -(-(max(s.offset, start) - s.offset) // w) * w  # first whole element
        hi = s.offset + (min(s.end, end) - s.offset) // w * w  # past the last whole element
        if hi <= lo:
            continue
        if lo > at:
            out.append(Segment(at - start, lo - at))
        out.append(Segment(lo - start, hi - lo, s.dtype))
        at = hi
    if at < end:
        out.append(Segment(at - start, end - at))
    return out


def segments(header: Header, offset: int, length: int) -> list[Segment]:
    """The segments of bytes ``[offset, offset + length)`` of the file ``header`` describes,
    relative to ``offset`` (a shard's range: pipeline/core/planner.py)."""
    return clip(spans(header), offset, length)


def shard_spans(head: bytes | memoryview, size: int) -> list[Segment]:
    """The typed runs of a shard of ``size`` bytes whose first bytes are ``head``: a shard of
    tensors is a safetensors file of its own (pipeline/core/planner.py), and anything else (a
    file's header shard, a chunk of an opaque file, a header ``head`` does not hold whole) has
    none: it is all bytes."""
    try:
        return spans(parse_header(bytes(head[:8 + int.from_bytes(bytes(head[:8]), "little")]), size))
    except HeaderError:
        return []
