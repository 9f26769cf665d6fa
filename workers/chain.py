"""Chain replication on a storage worker: an upload passed on to the next workers as it arrives.

``PUT /v1/shards/<sha256>?next=<node>@<url>,<node>@<url>`` (the query is signed with the rest
of the request, so only a holder of the cluster key chooses where bytes go): the worker stores
the shard as any upload, hashed as it arrives and refused before it is visible if it does not
match its name, and streams the same bytes on to the first worker named, with the rest of the
list, which does the same (HDFS's write pipeline). The trainer's link carries each byte once.

The answer's ``chain`` says, per downstream worker, what it answered, relayed: the control
plane counts no copy on that word, it re-hashes each from its own worker's disk. A downstream
hop that fails does not fail this worker's copy; the control plane sends that copy again.

Deadlines by progress, blame by evidence: ``stall=<seconds>`` (signed too) is how long a hop
may leave the transfer with no byte moving. This worker waits that long per worker after it
(:class:`~pipeline.cluster.client.Upload`), its upstream one more, and so on: when a hop
stalls, the worker right before it gives up first and its answer names that hop (``status``
None: no answer; else the HTTP status), while every worker before it is still waiting and is
not blamed (docs/design.md, "Deadlines by progress").
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, BinaryIO, cast
from urllib.parse import parse_qs

from pipeline.cluster.client import STALL_SECONDS, Upload, WorkerClient
from pipeline.cluster.decoding import decoding, read_into
from pipeline.errors import ShardRefused, WorkerError
from workers.shardstore import PutResult, ShardStore

#: Longest chain a worker accepts (RF above this is not a replication factor, it is a broadcast).
MAX_HOPS = 8
#: Bounds of a hop's stall timeout as a sender may set it.
STALL_RANGE = (0.1, 3600.0)


def parse_next(query: str) -> list[tuple[str, str]]:
    """The workers an upload goes on to, as (node id, url), from the request's query."""
    raw = parse_qs(query).get("next", [""])[0]
    hops = []
    for item in filter(None, raw.split(",")):
        node, sep, url = item.partition("@")
        if not sep or not node or not url.startswith("http://"):
            raise ShardRefused(400, f"next: {item[:120]!r} is not <node id>@http://HOST:PORT")
        hops.append((node, url))
    if len(hops) > MAX_HOPS:
        raise ShardRefused(400, f"next: {len(hops)} workers; at most {MAX_HOPS}")
    return hops


def parse_stall(query: str) -> float:
    """How long a hop may stall before this worker gives up on it, from the request's query."""
    raw = parse_qs(query).get("stall", [""])[0]
    if not raw:
        return STALL_SECONDS
    try:
        stall = float(raw)
    except ValueError:
        stall = -1.0
    if not STALL_RANGE[0] <= stall <= STALL_RANGE[1]:
        raise ShardRefused(400, f"stall: {raw[:40]!r} is not a number of seconds in {STALL_RANGE}")
    return stall


class Tee:
    """The request body, each piece read also sent down the chain."""

    def __init__(self, body: BinaryIO, down: Upload | None) -> None:
        self.body, self.down = body, down

    def readinto(self, view: memoryview) -> int:
        n = read_into(self.body, view)
        if n and self.down is not None:
            self.down.send(view[:n])
        return n

    def read(self, size: int = -1) -> bytes:
        chunk = self.body.read(size)
        if chunk and self.down is not None:
            self.down.send(chunk)
        return chunk


def put_and_forward(store: ShardStore, key: bytes, name: str, body: BinaryIO, length: int,
                    hops: Sequence[tuple[str, str]], *, codec: str | None = None, stall: float = STALL_SECONDS,
                    ) -> tuple[PutResult, list[dict[str, Any]], int]:
    """Store the upload here and pass it on along ``hops`` (``stall``: how long each may leave
    the transfer with no byte moving); what each downstream worker answered, and the bytes
    read from the wire. ``codec``: the body is frames of that codec (pipeline/cluster/wire.py),
    of ``length`` raw bytes, passed on as they are (the sender chose a codec every hop decodes)."""
    node, url = hops[0]
    down: Upload | None = None
    try:
        down = Upload(WorkerClient(url, key, node, timeout=stall), name, length, hops[1:], compress=codec)
    except WorkerError as exc:
        reached = _failed(hops, f"not reached from here: {exc}", exc.status)
    except ValueError as exc:
        reached = _failed(hops, f"not reached from here: {exc}", None)
    try:
        tee = Tee(body, down)
        if codec:
            raw = decoding(codec, tee, length)
            result = store.put(name, cast(BinaryIO, raw), length)
            raw.finish()  # to the stream's end: the next worker gets all of it
            wire = raw.wire
        else:
            result = store.put(name, cast(BinaryIO, tee), length)
            wire = length
    except BaseException:
        if down is not None:
            down.close()
        raise
    if down is not None:
        try:
            doc = down.finish()
            reached = [{"node": node, "ok": True, "created": bool(doc.get("created"))}, *doc.get("chain", [])]
        except WorkerError as exc:
            reached = _failed(hops, str(exc), exc.status)
    return result, reached, wire


def _failed(hops: Sequence[tuple[str, str]], why: str, status: int | None) -> list[dict[str, Any]]:
    """The first hop failed for ``why`` (``status``: what it answered; None: no answer, it was
    unreachable or stalled): the ones after it never got the bytes from it."""
    return [{"node": hops[0][0], "ok": False, "error": why[:300], "status": status},
            *({"node": n, "ok": False, "error": "not sent: the worker before it in the chain failed"}
              for n, _ in hops[1:])]
