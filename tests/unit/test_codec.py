"""The planes codec (pipeline/codec): every frame decodes to exactly the bytes it was made of,
alone; a frame that is corrupted or cut short is refused, never decoded into other bytes; and
the safetensors segments it splits by are the header's dtypes, element-aligned."""
from __future__ import annotations

import io
import os
import zlib

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save, save_file

from pipeline.codec import frames
from pipeline.codec.frames import RAW, ZSTD, decode, encode, encode_blocks, read_table
from pipeline.codec.planes import Layout
from pipeline.codec.segments import Segment, segments, shard_spans
from pipeline.core.header import DTYPE_BITS, parse_header
from pipeline.errors import CorruptFrame

DTYPES = ["BF16", "F16", "F32", "I64", "U8", None]
SLOW = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def weights(n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes()


def codings(frame: bytes) -> list[int]:
    table, _ = read_table(io.BytesIO(frame).read)
    return [coding for coding, _, _ in table.sections]


@st.composite
def framed(draw):
    """Bytes (some compressible, some noise) and segments of every dtype at any offsets."""
    size = draw(st.integers(0, 20_000))
    kind = draw(st.sampled_from(["noise", "zeros", "weights", "runs"]))
    if kind == "noise":
        data = draw(st.binary(min_size=size, max_size=size))
    elif kind == "zeros":
        data = bytes(size)
    elif kind == "weights":
        data = weights(size // 2 + 1, seed=draw(st.integers(0, 9)))[:size]
    else:
        data = bytes(np.repeat(np.frombuffer(draw(st.binary(min_size=1, max_size=64)), np.uint8), size)[:size])
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=6)))
    segs = [Segment(a, b - a, draw(st.sampled_from(DTYPES))) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
    return data, segs


@SLOW
@given(framed(), st.sampled_from([None, 1, 3]), st.integers(0, frames.MIN_TYPED + 1))
def test_every_frame_decodes_to_exactly_its_bytes(case, level, min_typed):
    """Given any bytes cut into segments of any dtype, odd lengths and tails included, when a
    frame is made of them, then it decodes alone to exactly those bytes."""
    data, segs = case
    old, frames.MIN_TYPED = frames.MIN_TYPED, min_typed  # small typed runs split too
    try:
        frame = encode(data, segs, level=level)
    finally:
        frames.MIN_TYPED = old
    assert decode(frame) == data
    assert decode(encode(data, segs, compress=False)) == data


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("length", [1, 2, 3, 4095, 4096, 4097, 10_001, 10_002, 10_003])
def test_odd_lengths_of_each_dtype_keep_their_tail(dtype, length):
    data = weights(length, torch.float32)[:length]
    frame = encode(data, [Segment(0, length, dtype)])
    assert decode(frame) == data


def test_bytes_that_do_not_shrink_go_raw():
    """Given noise, every section is raw and the frame costs only its tables."""
    data = os.urandom(1 << 20)
    frame = encode(data, [Segment(0, len(data), "BF16")])
    assert set(codings(frame)) == {RAW}
    assert len(frame) <= len(data) + 64
    assert decode(frame) == data


def test_all_zero_bytes_shrink_to_almost_nothing():
    data = bytes(1 << 20)
    for dtype in DTYPES:
        frame = encode(data, [Segment(0, len(data), dtype)])
        assert len(frame) < 1000 and decode(frame) == data


@pytest.mark.parametrize(("dtype", "most"), [(torch.bfloat16, 0.69), (torch.float16, 0.86), (torch.float32, 0.85)])
def test_weights_shrink_by_their_exponent_plane(dtype, most):
    """N(0, 0.02) weights: the exponent plane is compressed, the noise planes travel raw; bf16
    ends at or under 0.69 of its size (plain zstd: 0.78), fp16 and fp32 near what their
    exponent's entropy allows (0.84, 0.83; plain zstd: 0.92)."""
    name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    data = weights(1 << 20, dtype)
    frame = encode(data, [Segment(0, len(data), name)])
    assert decode(frame) == data
    assert len(frame) / len(data) <= most
    assert len(frame) < len(zstandard.ZstdCompressor(level=1).compress(data))
    assert codings(frame)[-1] == ZSTD and RAW in codings(frame)


def qwen_bf16_file(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("block", [4 * 1024 * 1024, 65_537])
def test_a_real_models_state_dict_round_trips_by_its_header(tmp_path, block):
    """Given a Qwen2 built from a config and saved in bf16, when the file is framed by the
    segments its header gives (blocks cut anywhere, even at an odd size), then the frames decode
    to the file and take less than plain zstd's bytes and 0.69 of the file."""
    data = qwen_bf16_file(tmp_path / "model.safetensors")
    header = parse_header(data, len(data))
    segs = segments(header, 0, len(data))
    assert {s.dtype for s in segs} == {None, "BF16"}
    out = list(encode_blocks(data, segs, block=block))
    assert b"".join(decode(f) for f in out) == data
    wire = sum(map(len, out))
    assert wire / len(data) <= 0.69
    assert wire < len(zstandard.ZstdCompressor(level=1).compress(data))


def test_blocks_cut_inside_elements_still_split_aligned():
    """A bf16 run that starts at an odd byte, cut into blocks whose cuts fall inside elements,
    still splits into aligned planes in every frame: as small as one frame of it (planes split
    one byte off shrink to 0.670 instead of 0.663)."""
    data = b"x" * 3 + weights(1 << 19)
    segs = [Segment(3, len(data) - 3, "BF16")]
    out = list(encode_blocks(data, segs, block=400_000))
    assert len(out) == 3 and b"".join(decode(f) for f in out) == data
    whole = len(encode(data, segs))
    assert sum(map(len, out)) <= whole + 0.002 * len(data)


@SLOW
@given(st.data())
def test_a_corrupted_frame_is_refused(data):
    """Given a frame of weights, header bytes and a tail, when any byte of it is changed, then
    decoding refuses it (or, where the change is in bytes no decoder reads, gives the same
    bytes): never other bytes, never another error."""
    raw = b"{header}" * 50 + weights(3000) + b"\x01"
    frame = bytearray(encode(raw, [Segment(400, 6000, "BF16"), Segment(6400, 1, "F32")]))
    at = data.draw(st.integers(0, len(frame) - 1))
    frame[at] ^= data.draw(st.integers(1, 255))
    try:
        assert decode(frame) == raw
    except CorruptFrame:
        pass


def test_a_section_that_declares_another_size_is_refused_before_it_is_allocated():
    """Given a frame whose zstd section's header, one bit flipped, declares exabytes (hypothesis
    found it: the decoder allocated what the header declared and raised MemoryError), then
    decoding refuses it as corrupt: a peer's bytes never size an allocation."""
    raw = b"{header}" * 50 + weights(3000) + b"\x01"
    frame = encode(raw, [Segment(400, 6000, "BF16"), Segment(6400, 1, "F32")])
    for at in range(len(frame)):
        for flip in (1, 16, 144):
            bad = bytearray(frame)
            bad[at] ^= flip
            try:
                assert decode(bad) == raw
            except CorruptFrame:
                pass


class Trickle:
    """A stream with ``read`` only, that answers at most ``most`` bytes a call (a socket)."""

    def __init__(self, data: bytes, most: int) -> None:
        self.data, self.at, self.most = data, 0, most

    def read(self, n: int = -1) -> bytes:
        n = self.most if n < 0 else min(n, self.most)
        part = self.data[self.at:self.at + n]
        self.at += len(part)
        return part


def stream_of(parts, kinds) -> tuple[bytes, bytes]:
    """The raw bytes of ``parts`` and a stream of their frames: each compressed by its
    segments, raw, or raw behind an empty frame, by ``kinds``."""
    out = []
    for (data, segs), kind in zip(parts, kinds + [0] * len(parts), strict=False):
        if kind == 2:
            out.append(encode(b"", compress=False))
        out.append(encode(data, segs) if kind == 0 else encode(data, compress=False))
    return b"".join(d for d, _ in parts), b"".join(out)


def read_all(reader, length: int, sizes) -> bytes:
    got, sizes = bytearray(), iter(sizes)
    while len(got) < length:
        buf = bytearray(min(next(sizes, 65536), length - len(got)))
        n = reader.readinto(buf)
        assert n, "the reader gave nothing before the declared length"
        got += buf[:n]
    reader.finish()
    return bytes(got)


@SLOW
@given(st.lists(framed(), min_size=1, max_size=4), st.lists(st.integers(0, 2), max_size=4),
       st.lists(st.integers(1, 25_000), max_size=20), st.integers(1, 70_000), st.booleans())
def test_a_stream_of_frames_reads_back_as_its_bytes_in_reads_of_any_size(parts, kinds, sizes, most, socket_like):
    """Given frames of every kind one after the other (compressed, raw, empty, of any length:
    a reader keeps its buffers from one frame to the next), read through a socket that answers
    in pieces or a file, in reads of any size, then the reader gives back exactly the bytes."""
    from pipeline.cluster.decoding import PlanesDecompressing

    raw, stream = stream_of(parts, kinds)
    body = Trickle(stream, most) if socket_like else io.BytesIO(stream)
    reader = PlanesDecompressing(body, len(raw))
    assert read_all(reader, len(raw), sizes) == raw
    assert reader.wire == len(stream)


@SLOW
@given(st.data())
def test_a_corrupted_stream_of_frames_is_refused(data):
    """Given a stream of a compressed frame, a raw one and an empty one, when any byte of it is
    changed, then the reader refuses it (or gives the same bytes, where no decoder reads the
    byte): never other bytes."""
    from pipeline.cluster.decoding import PlanesDecompressing
    from pipeline.errors import MalformedStream

    head = b"{header}" * 50 + weights(3000) + b"\x01"
    raw, stream = stream_of([(head, [Segment(400, 6000, "BF16")]), (weights(2000, seed=1), []),
                             (b"tail" * 100, [])], [0, 1, 2])
    bad = bytearray(stream)
    bad[data.draw(st.integers(0, len(bad) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        assert read_all(PlanesDecompressing(io.BytesIO(bytes(bad)), len(raw)), len(raw), [4096]) == raw
    except MalformedStream:
        pass


def crafted(segments, sections) -> bytes:
    """A frame of ``segments`` ((layout, raw bytes)) and ``sections`` ((coding, bytes)) as a
    sender that lies would make it: tables and CRC consistent, the rest whatever it says."""
    raw = sum(n for _, n in segments)
    tables = frames.HEAD.pack(frames.MAGIC, frames.VERSION, 0, len(segments), raw)
    tables += b"".join(frames.ENTRY.pack(layout, n) for layout, n in segments)
    tables += b"".join(frames.ENTRY.pack(coding, len(body)) for coding, body in sections)
    crc = zlib.crc32(tables)
    for coding, body in sections:
        if coding == RAW:
            crc = zlib.crc32(body, crc)
    return tables + frames.CRC.pack(crc) + b"".join(body for _, body in sections)


def test_an_empty_frame_after_the_last_bytes_is_checked_as_one_before_them():
    """Given a frame of no bytes whose zstd section is garbage (the CRC covers raw sections
    only), then a stream is refused with it after its last bytes as it is with it in the
    middle: the reader after the last frame decoded the tables and CRC of what followed, not
    its zstd sections, and took it. A well-formed empty frame is taken in either place."""
    from pipeline.cluster.decoding import PlanesDecompressing
    from pipeline.errors import MalformedStream

    data = b"{header}" * 100 + weights(2000)
    bad = crafted([(Layout.BYTES, 0)], [(ZSTD, b"\0" * 50)])
    for stream in (encode(data[:500]) + bad + encode(data[500:]), encode(data) + bad):
        reader = PlanesDecompressing(io.BytesIO(stream), len(data))
        with pytest.raises(MalformedStream):
            reader.read()
            reader.finish()
    for stream in (encode(data[:500]) + encode(b"") + encode(data[500:]), encode(data) + encode(b"")):
        reader = PlanesDecompressing(io.BytesIO(stream), len(data))
        assert reader.read() == data
        reader.finish()


@pytest.mark.parametrize("n", [2, 3])
def test_a_compressed_tail_is_refused_at_its_tables(n):
    """Given a frame whose F32 segment of 7 bytes says its 3-byte raw tail is zstd (the format
    has it raw: nothing checks its bytes otherwise), then it is refused at its tables: not a
    ValueError from copying 2 bytes into 3 (a 500 on a worker), not 3 unchecked bytes decoded."""
    frame = crafted([(Layout.F32, 7)], [(RAW, b"a"), (RAW, b"b"), (RAW, b"c"), (RAW, b"d"), (ZSTD, b"t" * n)])
    with pytest.raises(CorruptFrame, match="tail"):
        read_table(io.BytesIO(frame).read)
    with pytest.raises(CorruptFrame):
        decode(frame)


def test_a_frame_of_no_bytes_carries_no_body():
    """Given a frame that claims no bytes in zero-length F32 segments, each with four zstd
    sections of 1 KiB (zstd's bound for nothing: 65,535 of them are 256 MiB of body for a frame
    of nothing, read into a buffer the reader keeps), then it is refused at its tables, before
    its body is read: a zstd section shrinks its plane (the encoder keeps it raw otherwise), so
    a frame's body is at most its raw bytes."""
    from pipeline.cluster.decoding import PlanesDecompressing

    frame = crafted([(Layout.F32, 0)] * 100, [(ZSTD, b"\0" * 1024)] * 400)
    body = io.BytesIO(encode(b"abc") + frame)
    with pytest.raises(CorruptFrame, match="shrinks"):
        PlanesDecompressing(body, 1000).read()
    assert body.tell() < 4000 < len(frame)
    for data, segs in [(weights(5000), [Segment(0, 10_000, "BF16")]), (bytes(9000), []), (os.urandom(900), [])]:
        table, tables = read_table(io.BytesIO(encode(data, segs)).read)
        assert table.size - len(tables) <= table.raw


@SLOW
@given(st.data())
def test_a_truncated_frame_is_refused(data):
    raw = weights(5000) + b"tail"
    frame = encode(raw, [Segment(0, 10_000, "BF16")])
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(CorruptFrame):
        decode(frame[:cut])
    with pytest.raises(CorruptFrame):
        decode(frame + b"\0" * data.draw(st.integers(1, 9)))
    from pipeline.cluster.decoding import PlanesDecompressing
    from pipeline.errors import MalformedStream

    # A whole frame then one cut short, read as a stream of twice its bytes: the first comes
    # back whole, the second is refused as a corrupt frame (or, cut to nothing, as a short stream).
    reader = PlanesDecompressing(io.BytesIO(frame + frame[:cut]), 2 * len(raw))
    assert reader.read(len(raw)) == raw
    with pytest.raises(CorruptFrame if cut else MalformedStream):
        reader.read()


def test_a_frame_claiming_too_many_bytes_is_refused_before_anything_is_allocated():
    frame = bytearray(encode(b"abc"))
    frame[8:12] = (frames.MAX_RAW + 1).to_bytes(4, "little")
    with pytest.raises(CorruptFrame, match="claims"):
        decode(frame)


# -- segments of a safetensors range ---------------------------------------------------------

TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
         "U8": torch.uint8, "I32": torch.int32}


@st.composite
def files(draw):
    names = draw(st.lists(st.sampled_from(sorted(TORCH)), min_size=1, max_size=6))
    tensors = {f"t{i}": torch.zeros(draw(st.integers(0, 40)), dtype=TORCH[d]) for i, d in enumerate(names)}
    blob = save(tensors)
    start = draw(st.integers(0, len(blob)))
    return blob, start, draw(st.integers(0, len(blob) - start))


@settings(max_examples=300, deadline=None)
@given(files())
def test_segments_cover_a_range_by_the_dtypes_of_its_whole_elements(case):
    """Byte by byte: a byte is in a typed segment exactly when it belongs to an element of a
    bf16/fp16/fp32 tensor that lies wholly inside the range, and then of that dtype and at
    that element's place in the segment."""
    blob, start, length = case
    header = parse_header(blob, len(blob))
    segs = segments(header, start, length)
    assert [s.offset for s in segs] == [0, *(s.end for s in segs[:-1])][:len(segs)]
    assert all(s.length > 0 for s in segs)
    assert sum(s.length for s in segs) == length
    expected = [None] * length
    for t in header.tensors:
        w = DTYPE_BITS[t.dtype] // 8
        if t.dtype not in ("BF16", "F16", "F32"):
            continue
        for e in range(header.data_start + t.begin, header.data_start + t.end, w):
            if start <= e and e + w <= start + length:
                expected[e - start:e - start + w] = [(t.dtype, e)] * w
    for s in segs:
        for i in range(s.offset, s.end):
            if s.dtype is None:
                assert expected[i] is None
            else:
                dtype, element = expected[i]
                assert dtype == s.dtype and (element - start - s.offset) % (DTYPE_BITS[dtype] // 8) == 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 1000))
def test_a_shard_that_is_no_safetensors_file_is_all_bytes(head, extra):
    """A file's header shard, a chunk of an opaque file, anything: no typed runs, no error."""
    assert shard_spans(head, len(head) + extra) == []


def test_a_shard_of_tensors_is_split_by_its_own_header():
    blob = save({"a": torch.zeros(3000, dtype=torch.bfloat16), "b": torch.zeros(10, dtype=torch.int64)})
    (run,) = shard_spans(blob[:100 + int.from_bytes(blob[:8], "little")], len(blob))
    assert (run.dtype, run.length) == ("BF16", 6000)


def test_a_raw_frame_is_made_and_read_back_without_numpy():
    """A sender short of CPU sends raw frames (all bytes): making one and reading it back never
    loads numpy, which a fresh process's first frame would otherwise import (~0.1 s of CPU, on
    a host whose cores are full)."""
    import subprocess
    import sys

    code = ("import io, sys\n"
            "from pipeline.cluster.wire import raw_frame\n"
            "from pipeline.cluster.decoding import decoding\n"
            "data = bytes(range(256)) * 20_000\n"
            "reader = decoding('planes', io.BytesIO(raw_frame(data) + raw_frame(data)), 2 * len(data))\n"
            "assert reader.read() == data * 2\n"
            "reader.finish()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_frame_is_read_from_its_transport_in_steps():
    """Given a stream of 4 MiB frames behind a transport with ``read`` only (a server's request
    body, which gathers each read in a buffer of its own and copies it over), then the reader
    asks it for at most READ_STEP bytes at a time: a frame read at once cost a storage worker
    6-9 ms of CPU per 4 MiB through gunicorn's body, in steps ~2 ms."""
    from pipeline.cluster import decoding

    class Recording(Trickle):
        def read(self, n: int = -1) -> bytes:
            self.asked.append(n)
            return super().read(n)

    data = weights(2 << 20) + os.urandom(4 << 20)
    raw, stream = stream_of([(data[:4 << 20], [Segment(0, 4 << 20, "BF16")]), (data[4 << 20:], [])], [0, 1])
    body = Recording(stream, 1 << 30)
    body.asked = []
    assert read_all(decoding.PlanesDecompressing(body, len(raw)), len(raw), [1 << 20]) == raw
    assert max(body.asked) <= decoding.READ_STEP < 1 << 20


@SLOW
@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1))
def test_the_frames_checksum_is_zlibs_crc32(data, start):
    """The frames' CRC-32 (zlib-ng's, where it is installed) is zlib's function: a frame made
    where zlib-ng is missing reads where it is installed, and the other way round."""
    import zlib

    assert frames.crc32(data, start) == zlib.crc32(data, start)
    assert frames.crc32(memoryview(data)) == zlib.crc32(data)
