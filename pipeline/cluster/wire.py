"""Shard bytes on the wire: as they are, or compressed in planes frames when the link is slower
than the compressor (docs/design.md, "Compression on the wire").

A shard of bf16 tensors shrinks to about 0.66 of its size in the planes codec (pipeline/codec:
each value's exponent byte apart from its mantissa byte, the exponent plane through zstd, the
dtypes from the shard's own safetensors header), at 0.7-1 GB/s on one core here; anything else
(a file's header, an opaque file) to what zstd's fastest level makes of it (random bytes do not
shrink). Over a 100 Mbit link a shard then crosses in about 0.66 of the time; over loopback,
compressing only costs. So a transfer is compressed (``CKPT_WIRE_COMPRESSION=auto``, the
default) when:

- the peer is on another host (the connection's two ends have different addresses);
- the shard compresses: its first block, compressed as a sample, shrinks to ``MAX_RATIO`` of
  its size or less (a download uses what this process's compressed transfers shrank to);
- the link to that peer, in that direction, was measured slower than the compressor by
  ``MARGIN``: the raw bytes per second of the last transfer (a plain one runs at the link's
  rate; a compressed one at the link's rate divided by the ratio, or at the compressor's when
  that is the slower). A peer not measured yet is taken to be slower: a LAN link under
  about 5 Gbit/s is;
- the host that compresses has cores to spare: at least ``MIN_IDLE`` of its CPU time was idle
  over the last second (a training host busy feeding its GPUs keeps its cores; so does a
  worker, which then answers a download plain). Measured in the box at 1 Gbit: a store keeps
  81 % of its two cores busy without compressing, a restore 40 %; compressing made the store
  slower (11.0 -> 12.4 s) and the restore faster (10.6 -> 8.9 s).

An upload judges the cores block by block: one that starts while they are busy (the uploads
sent while detection hashes the file) and should last ``BUSY_START_SECONDS`` or more on its
link is still sent as frames, each block that finds them busy as a *raw* frame (its bytes as
they are: a copy and a CRC, no compression; :func:`raw_frame`), each that finds them idle
compressed, so that it compresses once the hashing is over instead of never. A block that
does not shrink to ``MAX_RATIO`` stops the compression of the rest of its transfer.

Compressed bytes are planes frames (pipeline/codec/frames.py), one per ``BLOCK`` of raw
bytes, each decodable alone, sent as a chunked body (an upload, passed on as they are along a
chain) or answer (a download); the raw length is in the request's signed query
(``?zstd=<bytes>``, the name it had when the frames were zstd's). The receiver decodes as it
reads, never past the declared length, and checks the SHA-256 of what it got as for any
transfer: the bytes are checked, not the encoding (invariant 4). A malformed stream is the
sender's error (400), like bytes that do not match.
"""
from __future__ import annotations

import ipaddress
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

from pipeline.codec import frames as planes
from pipeline.codec.segments import Segment, clip, shard_spans
from pipeline.errors import MalformedStream

#: Content-Type of a download answered in frames.
CONTENT_TYPE = "application/x-ckpt-planes"
#: Raw bytes per frame (and the sample a sender compresses first).
BLOCK = 4 * 1024 * 1024
#: Shards smaller than this (a safetensors file's header shard) always cross as they are.
MIN_SIZE = 64 * 1024
#: A shard whose sample shrinks less than this is sent as it is.
MAX_RATIO = 0.9
#: Compress only on a link this much slower than the compressor.
MARGIN = 1.25
#: Frames compressed ahead of the link.
AHEAD = 2
#: Compress only while at least this share of the host's CPU time is idle.
MIN_IDLE = 0.3
#: An upload that starts while the cores are busy is still declared compressed (its blocks
#: compress once they are idle) if it should last this long on its link: a shorter one is
#: unlikely to see them free, and its raw frames would cost the sender a copy that sendfile
#: does not (0.44 CPU-s per GiB measured, and the receiver 0.13 more).
BUSY_START_SECONDS = 2.0
#: Weight of a new measurement in the running estimates.
_NEW = 0.5


def is_loopback(host: str | None) -> bool:
    """Whether a host name or address is this host's loopback (``127.x``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def same_host(sock: socket.socket) -> bool:
    """Whether a connected socket's two ends are on this host (loopback, or our own address)."""
    try:
        peer = sock.getpeername()[0]
        return peer == sock.getsockname()[0] or is_loopback(peer)
    except OSError:
        return False


class CpuIdle:
    """The share of the CPU time of this process's CPUs (all of the host's, unless it is
    confined to some) that was idle over about the last second, sampled from /proc/stat by a
    daemon thread started on first use (1.0 where there is no /proc)."""

    def __init__(self, every: float = 0.5) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._started = False
        self._value = 1.0

    def idle(self) -> float:
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._sample, name="ckpt-cpu", daemon=True).start()
            return self._value

    def _sample(self) -> None:
        before = _cpu_times()
        while before is not None:
            time.sleep(self.every)
            now = _cpu_times()
            if now is None:
                return
            total, idle = now[0] - before[0], now[1] - before[1]
            if total > 0:
                with self._lock:  # half the newest half-second, half the one before
                    self._value = (self._value + idle / total) / 2
            before = now


def _cpu_times() -> tuple[int, int] | None:
    """(all, idle + iowait) jiffies since boot of the CPUs this process may run on."""
    try:
        with open("/proc/stat") as f:
            return cpu_times(f.read(), os.sched_getaffinity(0))
    except (OSError, ValueError, AttributeError):
        return None


def cpu_times(stat: str, cpus: set[int] | frozenset[int]) -> tuple[int, int]:
    """(all, idle + iowait) jiffies of ``cpus`` in the text of /proc/stat. A process confined to
    some of the host's CPUs (a container's cpuset, ``taskset``) judges what it may spare by them:
    the others' idle time is not its to use."""
    total = idle = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            break  # the CPU lines come first; the rest (interrupts) can be long
        if not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()]
        total, idle = total + sum(fields[:8]), idle + fields[3] + fields[4]
    if not total:
        raise ValueError("/proc/stat names none of this process's CPUs")
    return total, idle


#: This host's idle CPU, as every transfer in this process sees it.
CPU = CpuIdle()


class Meter:
    """What this process measured of its compressor and of each link (peer URL, direction)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compressor: float | None = None  # raw bytes/s through the codec, one core
        self.ratio = 0.8  # compressed / raw of this process's compressed transfers
        self.rates: dict[tuple[str, str], float] = {}  # raw bytes/s of the last transfers

    def worth_it(self, url: str, direction: str, ratio: float | None = None, *, cores: bool = True) -> bool:
        """Whether to compress a transfer over this link (the peer is known to be remote);
        ``cores=False``: whatever the host's idle CPU now (an upload judges it per block)."""
        with self._lock:
            if (self.ratio if ratio is None else ratio) > MAX_RATIO:
                return False
            rate, speed = self.rates.get((url, direction)), self.compressor
        return (rate is None or speed is None or rate * MARGIN < speed) and (not cores or CPU.idle() >= MIN_IDLE)

    def lasts(self, url: str, direction: str, size: int, seconds: float) -> bool:
        """Whether ``size`` bytes over this link should take ``seconds`` or more, at the rate
        of its last transfers (a link not measured yet is taken to be slow)."""
        with self._lock:
            rate = self.rates.get((url, direction))
        return rate is None or size >= rate * seconds

    def compressed(self, raw: int, seconds: float) -> None:
        """The codec compressed ``raw`` bytes in ``seconds`` of one thread's time."""
        if raw >= 1 << 20 and seconds > 0:
            self._update_speed(raw / seconds)

    def transfer(self, url: str, direction: str, raw: int, wire: int, seconds: float,
                 packed: tuple[int, int] | None = None) -> None:
        """A transfer of ``raw`` bytes (``wire`` on the link) took ``seconds``. ``packed``: the
        raw and compressed bytes of the blocks it compressed, where it sent others as they are."""
        if raw < 1 << 20 or seconds <= 0:
            return  # too small to say anything about the link
        packed_raw, packed_wire = (raw, wire) if packed is None else packed
        with self._lock:
            key = (url, direction)
            old = self.rates.get(key)
            self.rates[key] = raw / seconds if old is None else old + _NEW * (raw / seconds - old)
            if packed_wire != packed_raw and packed_raw >= 1 << 20:
                self.ratio += _NEW * (packed_wire / packed_raw - self.ratio)

    def _update_speed(self, speed: float) -> None:
        with self._lock:
            self.compressor = speed if self.compressor is None else self.compressor + _NEW * (speed - self.compressor)


#: This process's measurements (every transfer in it shares them).
METER = Meter()


def compress_block(data: bytes | memoryview, typed: Sequence[Segment] = (), at: int = 0) -> bytes:
    """The frame of a block at raw offset ``at`` of a shard whose typed runs are ``typed``
    (:func:`~pipeline.codec.segments.shard_spans`); the wall time it took is recorded as the
    compressor's speed (on a host whose cores are all busy, that is the speed it really gets)."""
    t = time.perf_counter()
    frame = planes.encode(data, clip(typed, at, len(data)))
    METER.compressed(len(data), time.perf_counter() - t)
    return frame


def raw_frame(data: bytes | memoryview) -> bytes:
    """A frame that holds ``data`` as it is: making it costs a copy and a CRC where
    compressing costs a core."""
    return planes.encode(data, compress=False)


class Frames:
    """The frames of ``header`` then ``length`` bytes of ``path`` from ``offset``, compressed
    ahead of the link in a helper thread (at most ``AHEAD`` frames waiting). ``first`` is
    the sample already compressed (the frame of the first block). ``per_block``: a block is
    compressed only if the host's cores are idle enough when it is read, else sent as a raw
    frame; a compressed block that does not shrink to ``MAX_RATIO`` ends the compressing."""

    def __init__(self, header: bytes, path: str, offset: int, length: int,
                 first: tuple[int, bytes] | None = None, *, per_block: bool = False) -> None:
        self.header, self.path, self.offset, self.length = header, path, offset, length
        self.first, self.per_block = first, per_block
        self.typed = shard_spans(header, len(header) + length)
        self.wire = 0
        #: raw and compressed bytes of the blocks that were compressed
        self.packed = (0, 0) if first is None else (first[0], len(first[1]))
        self._compressing = True  # until a block does not shrink (a sample that did not is never sent)
        self._q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=AHEAD)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[bytes]:
        self._thread = threading.Thread(target=self._produce, name="ckpt-planes", daemon=True)
        self._thread.start()
        try:
            while (item := self._q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                self.wire += len(item)
                yield item
        finally:
            self._stop.set()
            while self._thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    self._q.get(timeout=0.05)
                except queue.Empty:
                    pass

    def _put(self, item: bytes | BaseException | None) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            done = 0  # raw bytes framed so far
            if self.first is not None:
                done, frame = self.first
                if not self._put(frame):
                    return
            total = len(self.header) + self.length
            with open(self.path, "rb", buffering=0) as f:
                while done < total:
                    n = min(BLOCK, total - done)
                    block = bytearray(n)
                    view = memoryview(block)
                    filled = 0
                    if done < len(self.header):
                        part = self.header[done:done + n]
                        view[:len(part)] = part
                        filled = len(part)
                    while filled < n:
                        got = os.preadv(f.fileno(), [view[filled:]], self.offset + done + filled - len(self.header))
                        if not got:
                            raise OSError(f"{self.path} ended after {done + filled - len(self.header):,} of "
                                          f"{self.length:,} bytes from {self.offset:,}")
                        filled += got
                    if not self._put(self._frame(view, done)):
                        return
                    done += n
            self._put(None)
        except BaseException as exc:  # raised in the sending thread
            self._put(exc)

    def _frame(self, block: memoryview, at: int) -> bytes:
        if not self._compressing or self.per_block and CPU.idle() < MIN_IDLE:
            return raw_frame(block)
        frame = compress_block(block, self.typed, at)
        self.packed = (self.packed[0] + len(block), self.packed[1] + len(frame))
        if len(frame) > MAX_RATIO * len(block):
            self._compressing = False  # it does not shrink: the rest goes as it is
        return frame


def sample(header: bytes, path: str, offset: int, length: int) -> tuple[int, bytes, float]:
    """The first block's raw size, its frame, and how well it compressed (frame / raw)."""
    n = min(BLOCK, len(header) + length)
    head = header[:n]
    with open(path, "rb", buffering=0) as f:
        body = os.pread(f.fileno(), n - len(head), offset) if n > len(head) else b""
    raw = head + body
    if len(raw) != n:
        raise OSError(f"{path} ended after {len(body):,} of {length:,} bytes from {offset:,}")
    frame = compress_block(raw, shard_spans(header, len(header) + length))
    return n, frame, len(frame) / max(1, n)


class Decompressing:
    """``length`` raw bytes out of a stream of planes frames (a file-like object with ``read``).

    Never yields more than ``length``, and never decodes a frame that claims more than is left;
    a stream that is malformed, ends early or holds more is refused
    (:class:`~pipeline.errors.MalformedStream`, 400: the sender's error)."""

    def __init__(self, stream: Any, length: int) -> None:
        self.stream, self.length, self.left = _Counted(stream), length, length
        self._decoded = memoryview(b"")

    @property
    def wire(self) -> int:
        """Compressed bytes read so far."""
        return self.stream.count

    def readinto(self, view: memoryview | bytearray) -> int:
        """Fill ``view`` (as far as the declared length goes) from as many frames as it takes."""
        view = memoryview(view).cast("B")[: self.left]
        filled = 0
        while filled < len(view):
            if not len(self._decoded):
                self._decoded = memoryview(self._next_frame())
            n = min(len(view) - filled, len(self._decoded))
            view[filled:filled + n] = self._decoded[:n]
            self._decoded = self._decoded[n:]
            filled += n
            self.left -= n
        if filled and not self.left:
            self._at_end()  # before the last bytes are handed over: a shard is never stored from a stream that lies
        return filled

    def _next_frame(self) -> bytearray:
        raw = bytearray()
        while not raw:  # an empty frame (a raw frame of nothing) is allowed, and skipped
            frame = planes.read_frame(self.stream.read, most=self.left)  # a bomb is cut before it is decoded
            if frame is None:
                raise MalformedStream(f"compressed stream ended {self.left:,} bytes short of {self.length:,}")
            raw = planes.decode(frame)
        return raw

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

    _ended = False

    def _at_end(self) -> None:
        if len(self._decoded) or planes.read_frame(self.stream.read) is not None:
            raise MalformedStream(f"compressed stream holds more than its {self.length:,} bytes")
        while self.stream.read(64 * 1024):  # the rest of the transport (a chunked body's end)
            pass
        self._ended = True


class _Counted:
    """A stream that counts what is read from it."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream, self.count = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.count += len(data)
        return data


def file_frames(f: BinaryIO, sent: Callable[[int, int], None] | None = None) -> Iterator[bytes]:
    """A held shard's bytes as frames (a download asked with ``?zstd=1``), split by the dtypes
    of its own header if it is a shard of tensors; ``sent`` is told the raw and compressed
    bytes of each frame."""
    try:
        size = os.fstat(f.fileno()).st_size
        block = f.read(BLOCK)
        typed = shard_spans(block, size)
        at = 0
        while block:
            frame = compress_block(block, typed, at)
            if sent is not None:
                sent(len(block), len(frame))
            yield frame
            at += len(block)
            block = f.read(BLOCK)
    finally:
        f.close()
