"""A compressed transfer read back as its raw bytes: planes frames (this release) or zstd
frames (the previous release's wire, still taken from its senders and sent to its workers;
docs/design.md, "Compression on the wire").

Both readers keep the same promise: never more than the declared ``length`` (a frame, or a
zstd stream, claiming more is cut before it is decoded), and a stream that is malformed,
ends early or holds more is refused (:class:`~pipeline.errors.MalformedStream`, 400: the
sender's error) before its last bytes are handed over, so a shard is never stored from a
stream that lies. The bytes themselves are checked by their SHA-256 as for any transfer.
"""
from __future__ import annotations

from typing import Any, BinaryIO, cast

import zstandard

from pipeline.codec import frames as planes
from pipeline.errors import CorruptFrame, MalformedStream

#: The codecs of frames on the wire, by the name of their query parameter (``?planes=<raw
#: length>``, ``?zstd=<raw length>``) and in a worker's status (``"decodes"``).
PLANES, ZSTD = "planes", "zstd"
#: Content-Type of a body or an answer in each codec's frames.
CONTENT_TYPES = {PLANES: "application/x-ckpt-planes", ZSTD: "application/zstd"}
#: Most bytes asked of the transport at once. A server's body reader (gunicorn's) gathers a
#: read in a buffer of its own and copies it twice more to hand it over: a 4 MiB frame asked
#: for in one read cost a storage worker 7-9 ms of CPU, in reads of this size ~1.5 ms (zstd's
#: streaming reader asks for as much).
READ_STEP = 256 * 1024


class Counted:
    """A stream that counts what is read from it."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream, self.count = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.count += len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        n = read_into(self._stream, view)
        self.count += n
        return n


def read_into(stream: Any, view: memoryview) -> int:
    """Read from ``stream`` into ``view``: its ``readinto`` where it has one (a socket's
    response), else a ``read`` copied over (gunicorn's request body has none); bytes given."""
    if hasattr(stream, "readinto"):
        return int(stream.readinto(view) or 0)
    data = stream.read(len(view))
    view[:len(data)] = data
    return len(data)


class Decompressing:
    """``length`` raw bytes out of a stream of frames (a file-like object with ``read``);
    :func:`decoding` picks the reader of a codec."""

    codec = ""

    def __init__(self, stream: Any, length: int) -> None:
        self.stream, self.length, self.left = Counted(stream), length, length
        self._ended = False

    @property
    def wire(self) -> int:
        """Compressed bytes read so far."""
        return self.stream.count

    def readinto(self, view: memoryview | bytearray) -> int:
        """Fill ``view`` as far as the declared length goes; the bytes given."""
        view = memoryview(view).cast("B")[: self.left]
        n = self._fill(view) if len(view) else 0
        self.left -= n
        if n and not self.left:
            self._at_end()  # before the last bytes are handed over: a shard is never stored from a stream that lies
        return n

    def read(self, size: int = -1) -> bytes:
        buf = bytearray(self.left if size < 0 else min(size, self.left))
        n = self.readinto(buf)
        return bytes(buf[:n])

    def finish(self) -> None:
        """Raise unless the stream held exactly its raw bytes and was read to its end."""
        if self.left:
            raise MalformedStream(f"compressed stream ended {self.left:,} bytes short of {self.length:,}")
        if not self._ended:
            self._at_end()

    def _fill(self, view: memoryview) -> int:
        raise NotImplementedError

    def _more(self) -> bool:
        """Whether the stream holds anything past the declared length."""
        raise NotImplementedError

    def _at_end(self) -> None:
        if self._more():
            raise MalformedStream(f"compressed stream holds more than its {self.length:,} bytes")
        while self.stream.read(64 * 1024):  # the rest of the transport (a chunked body's end)
            pass
        self._ended = True


class PlanesDecompressing(Decompressing):
    """Planes frames (pipeline/codec/frames.py): a frame claiming more than is left is refused
    at its tables, before its body is read. Each frame's body is read into one buffer, kept
    for the next, and handed out from there: a frame of raw bytes (what a sender short of
    CPU sends) as it is, any other decoded into a second buffer, also kept."""

    codec = PLANES

    def __init__(self, stream: Any, length: int) -> None:
        super().__init__(stream, length)
        self._decoded = memoryview(b"")
        self._body, self._raw = bytearray(), bytearray()

    def _fill(self, view: memoryview) -> int:
        filled = 0
        while filled < len(view):
            if not len(self._decoded):
                self._decoded = self._next_frame(self.left - filled)
            n = min(len(view) - filled, len(self._decoded))
            view[filled:filled + n] = self._decoded[:n]
            self._decoded = self._decoded[n:]
            filled += n
        return filled

    def _next_frame(self, left: int) -> memoryview:
        """The raw bytes of the next frame (none for an empty frame: allowed, and skipped),
        ``left`` raw bytes being still to come; a view of this reader's buffers, good until the
        next frame is read."""
        try:
            table, tables = planes.read_table(self.stream.read)
        except EOFError:
            raise MalformedStream(f"compressed stream ended {left:,} bytes short of {self.length:,}") from None
        if table.raw > left:  # a bomb is cut before it is decoded
            raise CorruptFrame(f"planes frame holds {table.raw:,} raw bytes where at most {left:,} "
                               "were left to read")
        return self._decode(table, tables)

    def _decode(self, table: planes.Table, tables: bytes) -> memoryview:
        """The raw bytes of the frame whose tables were just read, its body read and checked."""
        bodies = planes.sections(table, tables, self._read_body(table.size - len(tables)))
        raw = planes.as_is(table, bodies)
        if raw is None:
            if len(self._raw) < table.raw:
                self._raw = bytearray(table.raw)
            raw = memoryview(self._raw)[:table.raw]
            planes.unpack(table, bodies, raw)
        return raw

    def _read_body(self, n: int) -> memoryview:
        if len(self._body) < n:
            self._body = bytearray(n)
        view = memoryview(self._body)[:n]
        got = 0
        while got < n:
            part = self.stream.readinto(view[got:got + READ_STEP])
            if not part:
                raise CorruptFrame(f"planes frame is truncated {n - got:,} bytes before its end")
            got += part
        return view

    def _more(self) -> bool:
        if len(self._decoded):
            return True
        while True:  # empty frames are allowed anywhere, the last ones too, checked as any other
            try:
                table, tables = planes.read_table(self.stream.read)
            except EOFError:
                return False
            if table.raw:
                return True  # refused at its tables: nothing of it is read on
            self._decode(table, tables)


class ZstdDecompressing(Decompressing):
    """zstd frames, as the previous release sends them (zstd's streaming decoder writes into
    the caller's buffer, never past the declared length: a bomb fills it and stops)."""

    codec = ZSTD

    def __init__(self, stream: Any, length: int) -> None:
        super().__init__(stream, length)
        self._reader = zstandard.ZstdDecompressor().stream_reader(cast(BinaryIO, self.stream), read_across_frames=True,
                                                                   read_size=READ_STEP)

    def _fill(self, view: memoryview) -> int:
        try:
            return self._reader.readinto(view)
        except zstandard.ZstdError as exc:
            raise MalformedStream(f"compressed stream is malformed ({exc})") from None

    def _more(self) -> bool:
        try:
            return bool(self._reader.read(1))
        except zstandard.ZstdError as exc:
            raise MalformedStream(f"compressed stream is malformed after its {self.length:,} bytes ({exc})") from None


def decoding(codec: str, stream: Any, length: int) -> Decompressing:
    """The reader of ``length`` raw bytes from ``stream``, frames of ``codec``."""
    return {PLANES: PlanesDecompressing, ZSTD: ZstdDecompressing}[codec](stream, length)
