"""Which copy of a shard to read: the one whose worker's link is least busy right now.

A storage worker's link (or its disk) bounds one stream; a restore that reads several shards
at once fills the host's link only if they come from different workers. Every shard transfer
this process has open is counted per worker, whichever restore or ``load_state_dict`` opened
it; a shard is read from the best kind of copy (live worker, verified; the manifest's rank)
whose worker has the fewest transfers open, then in the manifest's order (which already
spreads a checkpoint's shards over the workers by bytes).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager


class Links:
    """Open transfers per worker, in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def open_count(self, worker_id: str) -> int:
        with self._lock:
            return self._open[worker_id]

    def choose(self, copies: Sequence[tuple[str, str]], ranks: Sequence[int],
               tried: set[str]) -> tuple[str, str] | None:
        """The copy to read next (not one of ``tried``), counted as open until :meth:`done`;
        None when every copy was tried."""
        with self._lock:
            left = [i for i, (worker_id, _url) in enumerate(copies) if worker_id not in tried]
            if not left:
                return None
            best = min(left, key=lambda i: (ranks[i] if i < len(ranks) else 0, self._open[copies[i][0]], i))
            self._open[copies[best][0]] += 1
            return copies[best]

    def done(self, worker_id: str) -> None:
        with self._lock:
            self._open[worker_id] -= 1
            if self._open[worker_id] <= 0:
                del self._open[worker_id]

    @contextmanager
    def reading(self, copies: Sequence[tuple[str, str]], ranks: Sequence[int]) -> Iterator[Iterator[tuple[str, str]]]:
        """Copies to try in turn, each chosen when the one before it failed, each counted as
        open while it is being read."""
        def turns() -> Generator[tuple[str, str], None, None]:
            tried: set[str] = set()
            while (choice := self.choose(copies, ranks, tried)) is not None:
                tried.add(choice[0])
                try:
                    yield choice
                finally:
                    self.done(choice[0])

        gen = turns()
        try:
            yield gen
        finally:
            gen.close()  # the copy being read when the caller stopped is no longer open


#: The process's open transfers (every restore and load in it shares them).
LINKS = Links()
