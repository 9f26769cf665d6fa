"""Strict reading of safetensors headers, and writing the headers of shard files.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data section. Offsets are relative to the data section; this module insists
they cover it exactly: sorted, contiguous, non-overlapping, inside the file.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from pipeline.errors import HeaderError

#: The reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000

#: More dimensions than any real tensor has.
MAX_DIMS = 64
#: More elements than any file holds (2**60 bytes even at 1 bit each).
MAX_ELEMENTS = 2**63

#: Bits per element of every dtype safetensors defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    #: Offsets relative to the start of the data section.
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    #: Length of the JSON header (``N``); the data section starts at ``8 + N``.
    json_len: int
    file_size: int
    #: Tensors sorted by offset.
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return 8 + self.json_len

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_header(head: bytes, file_size: int, path: str = "<bytes>") -> Header:
    """Validate the first ``8 + N`` bytes of a safetensors file of ``file_size`` bytes.

    ``head`` may be longer than needed. Raises :class:`HeaderError` naming the problem.
    """
    if file_size < 8 or len(head) < 8:
        raise HeaderError(path, f"file has {file_size} bytes, fewer than the 8-byte header length", truncated=True)
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(path, f"header length {n:,} exceeds the {MAX_HEADER_BYTES:,}-byte bound")
    if 8 + n > file_size:
        raise HeaderError(path, f"header length {n:,} runs past the end of the {file_size:,}-byte file", truncated=True)
    if len(head) < 8 + n:
        raise HeaderError(path, f"only {len(head) - 8:,} of {n:,} header bytes could be read", truncated=True)
    raw = bytes(head[8 : 8 + n])
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(path, f"header is not valid UTF-8 JSON ({exc})") from None
    except RecursionError:  # hostile nesting ([[[[...]]]]): the decoder recurses per level
        raise HeaderError(path, "header JSON is nested too deeply") from None
    if not isinstance(doc, dict):
        raise HeaderError(path, "header JSON is not an object")

    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise HeaderError(path, "__metadata__ must map strings to strings")

    tensors = [_tensor(path, name, entry) for name, entry in doc.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    data_len = file_size - 8 - n
    pos = 0
    for t in tensors:
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a gap after the previous tensor"
            raise HeaderError(path, f"tensor {t.name!r} starts at data byte {t.begin:,} and {what} (ending at {pos:,})")
        pos = t.end
    if pos != data_len:
        if pos > data_len:
            raise HeaderError(
                path, f"tensors end at data byte {pos:,} but the file holds only {data_len:,} data bytes (truncated?)",
                truncated=True,
            )
        raise HeaderError(path, f"tensors end at data byte {pos:,} but the file has {data_len - pos:,} trailing bytes")
    return Header(json_len=n, file_size=file_size, tensors=tuple(tensors), metadata=metadata)


def _tensor(path: str, name: str, entry: Any) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(path, f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise HeaderError(path, f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise HeaderError(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
    ):
        raise HeaderError(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if end < begin:
        raise HeaderError(path, f"tensor {name!r}: data_offsets end {end:,} is before begin {begin:,}")
    if len(shape) > MAX_DIMS:
        raise HeaderError(path, f"tensor {name!r}: {len(shape)} dimensions (at most {MAX_DIMS})")
    elements = 1
    for d in shape:  # bounded: a hostile shape of thousands of huge dimensions stops here
        elements *= d
        if elements > MAX_ELEMENTS:
            raise HeaderError(path, f"tensor {name!r}: shape {str(shape)[:80]} has more elements than a file can hold")
    bits = elements * DTYPE_BITS[dtype]
    if bits % 8:
        raise HeaderError(path, f"tensor {name!r}: {dtype}{shape} is not a whole number of bytes")
    if end - begin != bits // 8:
        raise HeaderError(
            path, f"tensor {name!r}: {dtype}{shape} needs {bits // 8:,} bytes but data_offsets span {end - begin:,}"
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def shard_header(tensors: tuple[TensorInfo, ...] | list[TensorInfo]) -> bytes:
    """The ``8 + N`` header bytes of a safetensors file holding ``tensors`` back to back.

    Offsets are rebased to the first tensor; the JSON is padded with spaces to a
    multiple of 8 bytes, as the reference writer does. Deterministic: the same tensors
    give the same bytes, so unchanged shards keep their SHA-256 between checkpoints.
    """
    base = tensors[0].begin if tensors else 0
    doc = {
        t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin - base, t.end - base]}
        for t in tensors
    }
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
