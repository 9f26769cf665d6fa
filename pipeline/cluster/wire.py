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

Compressed bytes are frames, one per ``BLOCK`` of raw bytes, each decodable alone, sent as a
chunked body (an upload, passed on as they are along a chain) or answer (a download): planes
frames (pipeline/codec/frames.py), or zstd frames, the previous release's wire. The codec and
the raw length are in the request's signed query (``?planes=<bytes>``, ``?zstd=<bytes>``) and
its Content-Type. Hosts are upgraded one at a time, so both ways work across releases: a worker
says what it decodes in its status (``"decodes"``; :func:`announced`: one of the previous
release says nothing, and decodes zstd frames), and a sender sends planes frames only to a
worker, and through a chain only along workers, that all said so; zstd frames otherwise. A
download asks ``?zstd=1`` with the codecs it reads in its ``Accept`` header; a worker answers
the first of its own it names (:func:`accepted`), zstd frames to a client that names none,
and the client reads what the answer's Content-Type says. The receiver decodes as it reads
(pipeline/cluster/decoding.py), never past the declared length, and checks the SHA-256 of
what it got as for any transfer: the bytes are checked, not the encoding (invariant 4). A
malformed stream is the sender's error (400), like bytes that do not match.
"""
from __future__ import annotations

import ipaddress
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import zstandard

from pipeline.cluster.decoding import CONTENT_TYPES, PLANES, ZSTD
from pipeline.codec import frames as planes
from pipeline.codec.segments import Segment, clip, shard_spans

#: What this release decodes, best first (a worker's status says it: ``"decodes"``).
DECODES = (PLANES, ZSTD)
#: zstd's level for zstd frames (the previous release's wire): its fastest.
ZSTD_LEVEL = 1
#: Largest block of a zstd frame (the format's limit), for raw zstd frames.
RAW_BLOCK = 128 * 1024
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
    """Whether a host name or address is this host's loopback (``127.x``, ``::1``, ``localhost``,
    and ``::ffff:127.x``, as a dual-stack socket sees a loopback IPv4 client)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def own_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine: binding to it succeeds."""
    if host in ("0.0.0.0", "::"):  # binds anywhere, reaches nothing in particular
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _type, _proto, _name, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
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


def announced(status: Mapping[str, Any]) -> tuple[str, ...]:
    """The codecs a worker decodes, by its status answer: those it names (``"decodes"``); a
    worker of the previous release names none and decodes zstd frames (its status counts
    them: ``"zstd"``); one older still, none (it takes bytes as they are)."""
    said = status.get("decodes")
    if isinstance(said, list):
        return tuple(c for c in DECODES if c in said)
    return (ZSTD,) if isinstance(status.get("zstd"), dict) else ()


def common_codec(workers: Iterable[Sequence[str]], prefer: Sequence[str] = DECODES) -> str | None:
    """The first codec of ``prefer`` (this host's, best first: Settings.wire_codecs) that every
    one of ``workers`` (what each decodes) decodes: frames passed along a chain as they are must
    be read by every hop. None: bytes as they are."""
    decoders = [tuple(w) for w in workers]  # read once: each codec is tried against all of them
    return next((c for c in prefer if c in DECODES and all(c in w for w in decoders)), None)


def accepted(accept: str, decodes: Sequence[str] = DECODES) -> str:
    """The codec a download is answered in, by the request's ``Accept`` header: the first of
    ``decodes`` it names; zstd if it names none (the previous release asks with ``?zstd=1``
    alone, and reads zstd frames)."""
    types = {t.split(";", 1)[0].strip() for t in accept.split(",")}
    return next((c for c in decodes if CONTENT_TYPES[c] in types), ZSTD)


def compress_block(data: bytes | memoryview, typed: Sequence[Segment] = (), at: int = 0, codec: str = PLANES) -> bytes:
    """The frame of a block at raw offset ``at`` of a shard whose typed runs are ``typed``
    (:func:`~pipeline.codec.segments.shard_spans`; planes frames split by them); the wall time
    it took is recorded as the compressor's speed (on a host whose cores are all busy, that is
    the speed it really gets)."""
    t = time.perf_counter()
    if codec == ZSTD:
        frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    else:
        frame = planes.encode(data, clip(typed, at, len(data)))
    METER.compressed(len(data), time.perf_counter() - t)
    return frame


def raw_frame(data: bytes | memoryview, codec: str = PLANES) -> bytes:
    """A frame that holds ``data`` as it is: making it costs a copy (and a CRC) where
    compressing costs a core."""
    if codec == PLANES:
        return planes.encode(data, compress=False)
    # A zstd frame of raw blocks (RFC 8878): magic; frame header: 4-byte content size,
    # single segment (the window is the content)
    n = len(data)
    view = memoryview(data)
    parts: list[bytes | memoryview] = [b"\x28\xb5\x2f\xfd\xa0", n.to_bytes(4, "little")]
    at = 0
    while True:
        size = min(RAW_BLOCK, n - at)
        last = at + size >= n
        parts += [(int(last) | size << 3).to_bytes(3, "little"), view[at:at + size]]  # type 0: raw
        at += size
        if last:
            return b"".join(parts)


class Frames:
    """The frames (of ``codec``) of ``header`` then ``length`` bytes of ``path`` from ``offset``,
    compressed ahead of the link in a helper thread (at most ``AHEAD`` frames waiting). ``first``
    is the sample already compressed (the frame of the first block). ``per_block``: a block is
    compressed only if the host's cores are idle enough when it is read, else sent as a raw
    frame; a compressed block that does not shrink to ``MAX_RATIO`` ends the compressing."""

    def __init__(self, header: bytes, path: str, offset: int, length: int,
                 first: tuple[int, bytes] | None = None, *, per_block: bool = False, codec: str = PLANES) -> None:
        self.header, self.path, self.offset, self.length = header, path, offset, length
        self.first, self.per_block, self.codec = first, per_block, codec
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
            return raw_frame(block, self.codec)
        frame = compress_block(block, self.typed, at, self.codec)
        self.packed = (self.packed[0] + len(block), self.packed[1] + len(frame))
        if len(frame) > MAX_RATIO * len(block):
            self._compressing = False  # it does not shrink: the rest goes as it is
        return frame


def sample(header: bytes, path: str, offset: int, length: int, codec: str = PLANES) -> tuple[int, bytes, float]:
    """The first block's raw size, its frame, and how well it compressed (frame / raw)."""
    n = min(BLOCK, len(header) + length)
    head = header[:n]
    with open(path, "rb", buffering=0) as f:
        body = os.pread(f.fileno(), n - len(head), offset) if n > len(head) else b""
    raw = head + body
    if len(raw) != n:
        raise OSError(f"{path} ended after {len(body):,} of {length:,} bytes from {offset:,}")
    frame = compress_block(raw, shard_spans(header, len(header) + length), codec=codec)
    return n, frame, len(frame) / max(1, n)


def file_frames(f: BinaryIO, sent: Callable[[int, int], None] | None = None, codec: str = PLANES) -> Iterator[bytes]:
    """A held shard's bytes as frames of ``codec`` (a download asked with ``?zstd=1``), planes
    frames split by the dtypes of its own header if it is a shard of tensors; ``sent`` is told
    the raw and compressed bytes of each frame."""
    try:
        size = os.fstat(f.fileno()).st_size
        block = f.read(BLOCK)
        typed = shard_spans(block, size)
        at = 0
        while block:
            frame = compress_block(block, typed, at, codec)
            if sent is not None:
                sent(len(block), len(frame))
            yield frame
            at += len(block)
            block = f.read(BLOCK)
    finally:
        f.close()
