"""Byte planes of tensor elements: the reversible split the codec compresses (docs/design.md,
"Byte-grouped compression").

A bf16 value is a sign bit, 8 exponent bits and 7 mantissa bits. Trained or initialised
weights use a handful of exponents (about 2.7 bits of entropy in N(0, 0.02)) and mantissas that
are noise, so generic zstd, which sees the two bytes of each value interleaved, finds little to
shrink (0.78). Rotating each element left by one bit puts the whole exponent in one byte (the
sign moves to bit 0, beside the mantissa); taking that byte of every element as one *plane* and
the rest as another leaves a plane an entropy coder shrinks to a third and a plane of noise.
fp32 has the same exponent (its top 16 bits are a bf16), so it rotates the same way into four
planes; fp16's 5-bit exponent already sits in its high byte with the sign, and it is split
as it is.

Plane ``k`` holds byte ``k`` (little-endian) of every element after the rotation: for bf16 and
fp32 the last plane is the exponent. Split and merge are a few numpy shifts and ors over whole
arrays of elements each way, and a cast per plane: 2-4 GB/s on one core.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a frame is split or merged: a command that sends none never loads numpy
    import numpy as np


class Layout(IntEnum):
    """How a segment's bytes are cut into planes; the value is written in each frame."""

    #: bytes with no element structure (headers, integers, opaque files): one plane as it is
    BYTES = 0
    #: bf16: 2-byte elements rotated left one bit, the exponent plane last
    BF16 = 1
    #: fp16: 2-byte elements split as they are (sign and exponent in the high byte)
    F16 = 2
    #: fp32: 4-byte elements rotated left one bit, the exponent plane last
    F32 = 3


@dataclass(frozen=True)
class Shape:
    #: bytes per element (planes per segment)
    width: int
    #: rotate each element left one bit before splitting (the sign leaves the exponent's byte)
    rotate: bool


SHAPES: dict[Layout, Shape] = {
    Layout.BYTES: Shape(1, False),
    Layout.BF16: Shape(2, True),
    Layout.F16: Shape(2, False),
    Layout.F32: Shape(4, True),
}

#: safetensors dtype -> layout; every other dtype is compressed as bytes.
DTYPE_LAYOUTS: dict[str, Layout] = {"BF16": Layout.BF16, "F16": Layout.F16, "F32": Layout.F32}


def layout_of(dtype: str | None) -> Layout:
    """The layout of a safetensors dtype (``None``: bytes)."""
    return DTYPE_LAYOUTS.get(dtype or "", Layout.BYTES)


def split(data: bytes | bytearray | memoryview, layout: Layout) -> list[np.ndarray]:
    """The planes of ``data``, whose length must be a whole number of elements."""
    import numpy as np

    shape = SHAPES[layout]
    w = shape.width
    if len(data) % w:
        raise ValueError(f"{len(data):,} bytes are not whole {w}-byte elements")
    if w == 1:
        return [np.frombuffer(data, dtype=np.uint8)]
    u = np.frombuffer(data, dtype=f"<u{w}")
    if shape.rotate:
        r = u << 1
        r |= u >> (8 * w - 1)
    else:
        r = u.copy()
    planes = []
    for k in range(w):  # byte k of each element: its low byte once shifted right by 8k (a cast keeps it)
        if k:
            r >>= 8
        planes.append(r.astype(np.uint8))
    return planes


def merge(planes: list[np.ndarray], layout: Layout, out: memoryview) -> None:
    """Write the elements whose planes are ``planes`` into ``out`` (exactly their size)."""
    import numpy as np

    shape = SHAPES[layout]
    w = shape.width
    target = np.frombuffer(out, dtype=np.uint8)
    if w == 1:
        target[:] = planes[0]
        return
    elements = planes[-1].astype(f"<u{w}")  # widened, the high byte first
    for plane in reversed(planes[:-1]):
        elements <<= 8
        elements |= plane
    typed = target.view(f"<u{w}")
    if not shape.rotate:
        typed[:] = elements
        return
    np.right_shift(elements, 1, out=typed)
    elements <<= 8 * w - 1
    typed |= elements
