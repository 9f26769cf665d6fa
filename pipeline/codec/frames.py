"""Self-describing frames of the planes codec: one block of raw bytes each, decodable alone
(docs/design.md, "Byte-grouped compression").

A frame holds the segments of its block (pipeline/codec/segments.py); each segment is cut
into the planes of its layout (pipeline/codec/planes.py) and each plane is a *section*,
zstd-compressed when that shrinks it and raw otherwise. Layout, all integers little-endian::

    head      magic b"CKPL", version (u8) 1, flags (u8) 0, segments (u16), raw bytes (u32)
    segments  per segment: layout (u8), raw bytes (u32)
    sections  per segment, per section: coding (u8; 0 raw, 1 zstd), bytes in the frame (u32)
    crc       CRC-32 of everything above and of every raw section's bytes (u32)
    bodies    the sections' bytes, in table order

A segment of ``n`` bytes in a layout of ``w``-byte elements has ``w`` sections of ``n // w``
bytes (its planes), then one raw section of its last ``n % w`` bytes if any. A zstd section
is one zstd frame carrying its content size and XXH64 checksum, smaller than its plane (so a
frame's body is at most its raw bytes); a tail is raw. So every byte of a frame is
checked before anything is handed back: the tables and raw bytes by the CRC, compressed
planes by zstd's checksum, sizes against the tables; a frame that is truncated, corrupted or
claims more than :data:`MAX_RAW` bytes raises :class:`~pipeline.errors.CorruptFrame`.
"""
from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zstandard

try:  # zlib's CRC-32, the same function, with SIMD: 0.07 ms per 4 MiB here, zlib's own 0.97
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform zlib-ng has no wheel for: the same checksums, slower
    from zlib import crc32

from pipeline.codec.planes import SHAPES, Layout, layout_of, merge, split
from pipeline.codec.segments import Segment, clip
from pipeline.errors import CorruptFrame

if TYPE_CHECKING:  # imported where a frame is decoded (pipeline/codec/planes.py)
    import numpy as np

MAGIC = b"CKPL"
VERSION = 1
HEAD = struct.Struct("<4sBBHI")
ENTRY = struct.Struct("<BI")
CRC = struct.Struct("<I")
RAW, ZSTD = 0, 1
#: Most raw bytes one frame may claim (a decoder allocates this much before checking it).
MAX_RAW = 64 * 1024 * 1024
#: Typed runs shorter than this are compressed as bytes (a bias of 64 values shrinks no
#: better split, and each section costs table entries and a zstd frame header).
MIN_TYPED = 4096
#: zstd level for bytes (headers, integers, opaque files: repeats are what shrinks them).
BYTES_LEVEL = 1
#: zstd for planes: an exponent plane shrinks by its symbol frequencies, not by repeats, so a
#: tiny match finder that only takes long matches leaves zstd's Huffman coder the literals:
#: 0.663 of a bf16 block instead of 0.680 at level 1, and about twice as fast (measured on
#: N(0, 0.02) weights, bench/codec.py).
PLANE_PARAMS = {"strategy": zstandard.STRATEGY_FAST, "window_log": 17, "hash_log": 6, "chain_log": 6,
                "search_log": 1, "min_match": 7, "target_length": 0}

#: A section this long or longer is compressed whole only if its first bytes shrink: this many,
#: below this ratio (zstd's frame and Huffman tables cost ~1 % on a sample this size).
SAMPLE = 64 * 1024
SAMPLE_RATIO = 0.97

_local = threading.local()


def _compressor(level: int | None) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (``None``: :data:`PLANE_PARAMS`); a context is
    not thread-safe and costs an allocation to make."""
    cache: dict[int | None, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        if level is None:
            params = zstandard.ZstdCompressionParameters(**PLANE_PARAMS, write_checksum=1, write_content_size=1)
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def normalise(segments: Sequence[Segment], size: int) -> list[Segment]:
    """``segments`` covering exactly ``[0, size)``: gaps and short typed runs become bytes, and
    neighbouring bytes one segment. Raises ValueError for segments out of order or bounds."""
    out: list[Segment] = []

    def add(offset: int, length: int, dtype: str | None) -> None:
        if not length:
            return
        if dtype is not None and (length < MIN_TYPED or layout_of(dtype) is Layout.BYTES):
            dtype = None
        if out and dtype is None and out[-1].dtype is None:
            out[-1] = Segment(out[-1].offset, out[-1].length + length)
        else:
            out.append(Segment(offset, length, dtype))

    at = 0
    for s in segments:
        if s.offset < at or s.end > size or s.length < 0:
            raise ValueError(f"segment {s} is out of order or outside the {size:,} bytes")
        add(at, s.offset - at, None)
        add(s.offset, s.length, s.dtype)
        at = s.end
    add(at, size - at, None)
    return out


def encode(data: bytes | bytearray | memoryview, segments: Sequence[Segment] = (), *,
           level: int | None = None, compress: bool = True) -> bytes:
    """The frame of ``data`` (at most :data:`MAX_RAW` bytes) cut by ``segments`` (relative to
    ``data``; none: all bytes). ``level``: zstd level for planes (``None``: :data:`PLANE_PARAMS`).
    ``compress=False``: every section raw (a copy and a CRC, for a host with no cores to spare)."""
    view = memoryview(data).cast("B")
    if len(view) > MAX_RAW:
        raise ValueError(f"a frame holds at most {MAX_RAW:,} bytes, not {len(view):,}")
    segs = normalise(segments, len(view))
    table = [HEAD.pack(MAGIC, VERSION, 0, len(segs), len(view))]
    table += [ENTRY.pack(layout_of(s.dtype), s.length) for s in segs]
    bodies: list[bytes | memoryview] = []
    raw_parts: list[bytes | memoryview] = []
    for s in segs:
        layout = layout_of(s.dtype)
        chunk = view[s.offset:s.end]
        whole = len(chunk) - len(chunk) % SHAPES[layout].width
        # Bytes are their own one plane: no numpy (a raw frame, all bytes, never loads it).
        sections = ([chunk] if layout is Layout.BYTES
                    else [plane.data.cast("B") for plane in split(chunk[:whole], layout)])
        if whole < len(chunk):
            sections.append(chunk[whole:])
        cctx = _compressor(BYTES_LEVEL if layout is Layout.BYTES else level) if compress else None
        for i, plane in enumerate(sections):
            body: bytes | memoryview = plane
            coding = RAW
            if cctx is not None and i < len(sections) - (whole < len(chunk)) and len(body) \
                    and _may_shrink(cctx, body):
                packed = cctx.compress(body)
                if len(packed) < len(body):
                    body, coding = packed, ZSTD
            table.append(ENTRY.pack(coding, len(body)))
            bodies.append(body)
            if coding == RAW:
                raw_parts.append(body)
    crc = crc32(b"".join(table))
    for part in raw_parts:
        crc = crc32(part, crc)
    return b"".join([*table, CRC.pack(crc), *bodies])


def _may_shrink(cctx: zstandard.ZstdCompressor, body: bytes | memoryview) -> bool:
    """Whether ``body`` is worth compressing whole: a long one only if its first
    :data:`SAMPLE` bytes shrink below :data:`SAMPLE_RATIO` (a bf16 mantissa plane, noise, never
    does: compressing it whole cost 0.7 ms per 4 MiB block for nothing)."""
    if len(body) < 4 * SAMPLE:
        return True
    return len(cctx.compress(body[:SAMPLE])) < SAMPLE_RATIO * SAMPLE


@dataclass(frozen=True)
class Table:
    """A frame's tables, read and checked for consistency (not yet against its CRC)."""

    raw: int
    #: (layout, raw bytes) per segment
    segments: tuple[tuple[Layout, int], ...]
    #: (coding, bytes in the frame, raw bytes) per section
    sections: tuple[tuple[int, int, int], ...]

    @property
    def tables_size(self) -> int:
        return HEAD.size + ENTRY.size * (len(self.segments) + len(self.sections)) + CRC.size

    @property
    def size(self) -> int:
        return self.tables_size + sum(n for _, n, _ in self.sections)


def _head(buf: bytes | memoryview) -> tuple[int, int]:
    magic, version, flags, nseg, raw = HEAD.unpack(buf)
    if magic != MAGIC:
        raise CorruptFrame(f"not a planes frame: it starts {bytes(magic)!r}, not {MAGIC!r}")
    if version != VERSION or flags:
        raise CorruptFrame(f"planes frame of version {version} with flags {flags}: this reader knows "
                           f"version {VERSION} without flags")
    if raw > MAX_RAW:
        raise CorruptFrame(f"planes frame claims {raw:,} raw bytes, more than the {MAX_RAW:,} a frame holds")
    return nseg, raw


def _segment_table(buf: bytes | memoryview, nseg: int, raw: int) -> list[tuple[Layout, int]]:
    segs = []
    for i in range(nseg):
        code, length = ENTRY.unpack_from(buf, i * ENTRY.size)
        try:
            segs.append((Layout(code), length))
        except ValueError:
            raise CorruptFrame(f"planes frame: segment {i} has layout {code}, unknown to this reader") from None
    if sum(n for _, n in segs) != raw:
        raise CorruptFrame(f"planes frame: its segments hold {sum(n for _, n in segs):,} bytes, "
                           f"its head says {raw:,}")
    return segs


def _section_sizes(segs: Sequence[tuple[Layout, int]]) -> list[tuple[int, bool]]:
    """Raw bytes of each section of ``segs``, in order, and whether it is a plane (a tail is
    raw: nothing but the CRC checks its bytes)."""
    out = []
    for layout, length in segs:
        w = SHAPES[layout].width
        out += [(length // w, True)] * w + ([(length % w, False)] if length % w else [])
    return out


def _section_table(buf: bytes | memoryview, sizes: Sequence[tuple[int, bool]]) -> list[tuple[int, int, int]]:
    out = []
    for i, (raw, plane) in enumerate(sizes):
        coding, n = ENTRY.unpack_from(buf, i * ENTRY.size)
        if coding == RAW and n != raw:
            raise CorruptFrame(f"planes frame: raw section {i} holds {n:,} bytes, not its {raw:,}")
        if coding == ZSTD and not plane:
            raise CorruptFrame(f"planes frame: section {i} is a segment's tail, and is not raw")
        # A zstd section shrinks its plane (the encoder keeps it raw otherwise), so a frame's
        # body is at most its raw bytes: a frame of nothing in 65,535 empty segments of four
        # sections of zstd's bound (1 KiB each) was 256 MiB of body, read before it was refused.
        if coding == ZSTD and n >= raw:
            raise CorruptFrame(f"planes frame: zstd section {i} is {n:,} bytes for {raw:,} raw bytes "
                               "(a zstd section shrinks its plane)")
        if coding not in (RAW, ZSTD):
            raise CorruptFrame(f"planes frame: section {i} has coding {coding}, which this reader does not know")
        out.append((coding, n, raw))
    return out


def read_table(read: Callable[[int], bytes | memoryview]) -> tuple[Table, bytes]:
    """A frame's tables from ``read(n)`` (which answers up to ``n`` bytes, fewer only at the
    end), and the bytes read. Raises :class:`EOFError` if the stream ended before a frame."""
    head = _exactly(read, HEAD.size, 0)
    nseg, raw = _head(head)
    seg_buf = _exactly(read, ENTRY.size * nseg, len(head))
    segs = _segment_table(seg_buf, nseg, raw)
    sizes = _section_sizes(segs)
    sec_buf = _exactly(read, ENTRY.size * len(sizes) + CRC.size, len(head) + len(seg_buf))
    table = Table(raw, tuple(segs), tuple(_section_table(sec_buf, sizes)))
    return table, bytes(head) + bytes(seg_buf) + bytes(sec_buf)


def _exactly(read: Callable[[int], bytes | memoryview], n: int, before: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = read(n - got)
        if not part:
            if not before and not got:
                raise EOFError("no frame")
            raise CorruptFrame(f"planes frame is truncated after {before + got:,} bytes")
        parts.append(bytes(part))
        got += len(part)
    return b"".join(parts)


def decode(frame: bytes | bytearray | memoryview) -> bytearray:
    """The raw bytes of one whole frame; raises :class:`~pipeline.errors.CorruptFrame` unless
    every byte of it checks out."""
    view = memoryview(frame).cast("B")
    pos = 0

    def read(n: int) -> memoryview:
        nonlocal pos
        part = view[pos:pos + n]
        pos += len(part)
        return part

    try:
        table, tables = read_table(read)
    except EOFError:
        raise CorruptFrame("planes frame is empty") from None
    if len(view) != table.size:
        raise CorruptFrame(f"planes frame is {len(view):,} bytes, its tables say {table.size:,}"
                           + (" (truncated)" if len(view) < table.size else ""))
    out = bytearray(table.raw)
    unpack(table, sections(table, tables, view[len(tables):]), memoryview(out))
    return out


def sections(table: Table, tables: bytes, body: memoryview) -> list[memoryview]:
    """The sections of a frame whose tables are ``tables`` and the rest ``body`` (exactly
    ``table.size - len(tables)`` bytes), each a view of ``body``, once the CRC-32 checked the
    tables and every raw section."""
    if len(body) != table.size - len(tables):
        raise CorruptFrame(f"planes frame holds {len(body):,} bytes after its tables, they say "
                           f"{table.size - len(tables):,}")
    out, pos = [], 0
    crc = crc32(memoryview(tables)[:-CRC.size])
    for coding, n, _ in table.sections:
        out.append(body[pos:pos + n])
        pos += n
        if coding == RAW:
            crc = crc32(out[-1], crc)
    if crc != CRC.unpack(tables[-CRC.size:])[0]:
        raise CorruptFrame("planes frame is corrupted: its CRC-32 does not match its tables and raw bytes")
    return out


def as_is(table: Table, bodies: Sequence[memoryview]) -> memoryview | None:
    """The raw bytes of a frame that holds them as they are (one raw section of bytes: what a
    sender with no cores to spare sends), checked by :func:`sections`; None for any other."""
    if len(table.segments) == 1 and table.segments[0][0] is Layout.BYTES and table.sections[0][0] == RAW:
        return bodies[0]
    return None


def unpack(table: Table, bodies: Sequence[memoryview], out: memoryview) -> None:
    """Write the raw bytes of a frame whose sections are ``bodies`` (checked by
    :func:`sections`) into ``out``, exactly ``table.raw`` bytes. Sections of bytes are copied
    (or decompressed) into place; only typed segments go through numpy's merge."""
    if len(out) != table.raw:
        raise ValueError(f"{len(out):,} bytes to write a frame of {table.raw:,} into")
    dctx = zstandard.ZstdDecompressor()
    entries = iter(zip(table.sections, bodies, strict=True))
    at = 0
    for index, (layout, length) in enumerate(table.segments):
        w = SHAPES[layout].width
        if w == 1:
            entry, body = next(entries)
            out[at:at + length] = body if entry[0] == RAW else _plain(dctx, entry, body, index)
            at += length
            continue
        planes = [_section(dctx, *next(entries), index) for _ in range(w)]
        whole = length - length % w
        merge(planes, layout, out[at:at + whole])
        if whole < length:
            _, body = next(entries)  # the raw tail: its length was checked against the table
            out[at + whole:at + length] = body
        at += length


def _section(dctx: zstandard.ZstdDecompressor, entry: tuple[int, int, int], body: memoryview,
             segment: int) -> np.ndarray:
    import numpy as np

    coding, _, raw = entry
    return np.frombuffer(body if coding == RAW else _plain(dctx, entry, body, segment), dtype=np.uint8)


def _plain(dctx: zstandard.ZstdDecompressor, entry: tuple[int, int, int], body: memoryview, segment: int) -> bytes:
    """The bytes of a zstd section, exactly its table's raw size."""
    _, _, raw = entry
    try:
        # A zstd frame declares its size, and the decoder allocates what it declares: a frame
        # whose header a flipped bit made claim exabytes raised MemoryError. Refused unless it
        # declares its table's size (or none, when max_output_size bounds it).
        declared = zstandard.frame_content_size(body)
        if declared not in (raw, zstandard.CONTENTSIZE_UNKNOWN):
            raise CorruptFrame(f"planes frame: a zstd section of segment {segment} declares {declared:,} bytes, "
                               f"not its {raw:,}")
        plain = dctx.decompress(body, max_output_size=raw)
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"planes frame: a zstd section of segment {segment} is corrupted ({exc})") from None
    if len(plain) != raw:
        raise CorruptFrame(f"planes frame: a zstd section of segment {segment} holds {len(plain):,} bytes, "
                           f"not its {raw:,}")
    return plain


def encode_blocks(data: bytes | bytearray | memoryview, segments: Sequence[Segment] = (), *,
                  block: int = 4 * 1024 * 1024, level: int | None = None) -> Iterator[bytes]:
    """The frames of ``data`` in blocks of ``block`` bytes, each cut by the segments that fall in
    it (an element a cut splits is bytes in both frames; the rest stay aligned)."""
    view = memoryview(data).cast("B")
    typed = [s for s in normalise(segments, len(view)) if s.dtype is not None]
    for at in range(0, len(view), block):
        end = min(len(view), at + block)
        yield encode(view[at:end], clip(typed, at, end - at), level=level)
