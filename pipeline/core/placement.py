"""Replica placement by weighted rendezvous hashing. Pure.

Each (shard, worker) pair gets a score ``-weight / ln(u)`` with ``u`` uniform in (0, 1)
derived from SHA-256 of the pair; a shard's replicas go to the highest scores. The weight
is the worker's free space (in whole GiB, so small fluctuations do not move shards).
Adding or losing a worker moves only the shards whose top-RF set it enters or leaves.
When zones are known, replicas of one shard prefer distinct zones.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from pipeline.errors import PlacementError

GiB = 1024**3


@dataclass(frozen=True)
class Candidate:
    id: str
    free_bytes: int
    zone: str = ""


def score(shard: str, worker: Candidate) -> float:
    digest = hashlib.sha256(f"{shard}/{worker.id}".encode()).digest()
    u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64
    weight = max(1, worker.free_bytes // GiB)
    return -weight / math.log(u)


def place(shard: str, workers: list[Candidate], rf: int, *, exclude: frozenset[str] = frozenset()) -> list[str]:
    """Ids of ``rf`` distinct workers for ``shard``, best first; ``exclude`` never chosen."""
    pool = [w for w in workers if w.id not in exclude]
    if len(pool) < rf:
        raise PlacementError(rf, len(pool))
    ranked = sorted(pool, key=lambda w: (score(shard, w), w.id), reverse=True)
    chosen: list[Candidate] = []
    zones: set[str] = set()
    for w in ranked:  # first pass: one replica per zone
        if len(chosen) < rf and (not w.zone or w.zone not in zones):
            chosen.append(w)
            if w.zone:
                zones.add(w.zone)
    for w in ranked:  # then fill up when there are fewer zones than replicas
        if len(chosen) < rf and w not in chosen:
            chosen.append(w)
    return [w.id for w in chosen]


def chain_orders(contents: list[tuple[int, list[str]]]) -> list[list[str]]:
    """For each content (its size and the workers its copies go to), the order its chain
    visits them: the first is the one the host sends to (:class:`ChainBalance`, in the given
    order)."""
    balance = ChainBalance()
    return [balance.order(size, workers) for size, workers in contents]


class ChainBalance:
    """The order chains visit their workers, content after content.

    Greedy: the first hop is the worker that has been first the fewest bytes so far (ties:
    the one receiving the fewest bytes in all, then the id), the others follow by the bytes
    they receive. So every worker's link carries about its share of the host's bytes, and
    consecutive contents (sent at about the same time) go to different first hops, instead
    of rendezvous order's luck deciding which worker the host feeds.
    """

    def __init__(self) -> None:
        self.first: dict[str, int] = {}
        self.received: dict[str, int] = {}

    def order(self, size: int, workers: list[str]) -> list[str]:
        first, received = self.first, self.received
        order = sorted(workers, key=lambda w: (first.get(w, 0), received.get(w, 0), w))
        if order:
            first[order[0]] = first.get(order[0], 0) + size
            order[1:] = sorted(order[1:], key=lambda w: (received.get(w, 0), w))
        for w in order:
            received[w] = received.get(w, 0) + size
        return order
