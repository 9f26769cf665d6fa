"""Hashing off the scan thread, one lane per run (docs/design.md, "Bounded detection work").

The watcher's scan finds a checkpoint complete in the time of a few header reads; hashing it
takes as long as reading every byte. So the scan hands each complete checkpoint to this pool
and goes on with the other runs. Each run is a lane: its checkpoints are hashed in the order
found, by one thread at a time; the lanes are served in turn by ``threads`` threads (a lane's
next checkpoint queues behind the other lanes' work already waiting). One run thus holds at
most one thread: a big checkpoint in one run never delays another run's while fewer than
``threads`` runs are hashing at once.

A lane whose thread finds no other lane waiting goes on with its own next checkpoints, a batch
of at most ``batch`` of them and ``batch_seconds`` (a run saving faster than one save at a
time is recorded: its backlog costs one transaction and one send per batch, not per save);
work that needs recording returns :class:`Staged`, and the batch's staged items are recorded
together by ``record``, in the order found, at the batch's end. A batch takes after its first
only checkpoints of at most ``batch_bytes`` (their hashing is short): a bigger one, hashed for
minutes at real sizes, starts a turn of its own, so what the batch hashed before it is recorded
(and its uploads start) meanwhile, not once it is hashed.

A piece of work runs on a pool thread and returns what to change in the watcher's own state,
a function that the watcher applies on its thread (:meth:`finished`); an exception it raises
is re-raised there. Threads are daemons: stopping the watcher does not wait for a hash (what
was not recorded is found again at the next start).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: What a piece of work changes in the watcher, applied on its thread; returns seconds until the
#: entry needs a new look, or None.
Apply = Callable[[], float | None]
#: Most checkpoints of one lane taken in one turn, and for how long a turn goes on taking them.
BATCH = 32
BATCH_SECONDS = 0.5


@dataclass(frozen=True)
class Staged:
    """Work hashed, to be recorded with its batch (``HashPool(record=...)``)."""

    item: Any


Work = Callable[[], Apply | Staged]
#: Records a batch's staged items (in the order found) in one go; one Apply per item.
Record = Callable[[list[Any]], list[Apply]]


def raising(exc: BaseException) -> Apply:
    """An Apply that raises ``exc`` on the watcher's thread (reported against its entry)."""
    def apply() -> None:
        raise exc
    return apply


def _no_record(items: list[Any]) -> list[Apply]:
    raise TypeError("work returned Staged to a pool without a record function")


class HashPool:
    """``threads`` threads hashing the checkpoints the scan hands over, each run in its own lane."""

    def __init__(self, threads: int, *, done: Callable[[str], None] = lambda run: None,
                 record: Record = _no_record, batch: int = BATCH, batch_seconds: float = BATCH_SECONDS,
                 batch_bytes: int | None = None) -> None:
        """``done(run)`` is called (on a pool thread) each time a batch of ``run`` ends;
        ``batch_bytes``: the largest checkpoint a batch takes after its first (None: any)."""
        self._done, self._record = done, record
        self._batch, self._batch_seconds, self._batch_bytes = max(1, batch), batch_seconds, batch_bytes
        self._lock = threading.Condition()
        self._lanes: dict[str, deque[tuple[str, Work, int]]] = {}  # run -> its work not started yet (and size)
        self._keys: set[str] = set()       # queued, being hashed, or done and not yet applied
        self._pending = 0                  # queued or being hashed
        self._ready: queue.SimpleQueue[tuple[str, str, Work, int] | None] = queue.SimpleQueue()
        self._finished: deque[tuple[str, str, Apply]] = deque()
        self._threads = [threading.Thread(target=self._serve, name=f"ckpt-hash-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def busy(self, key: str) -> bool:
        """Whether ``key`` is queued, being hashed or done and not yet taken by :meth:`finished`
        (the scan leaves it alone meanwhile: it is hashed once)."""
        with self._lock:
            return key in self._keys

    def submit(self, run: str, key: str, work: Work, size: int = 0) -> None:
        """Hash ``key`` of ``run`` (``size`` bytes) by ``work``, after the lane's earlier work;
        once at a time per key."""
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
            self._pending += 1
            lane = self._lanes.get(run)
            if lane is None:  # an idle lane: straight to the threads
                self._lanes[run] = deque()
                self._ready.put((run, key, work, size))
            else:
                lane.append((key, work, size))

    def finished(self) -> list[tuple[str, str, Apply]]:
        """``(run, key, apply)`` of the work done since the last call, in the order it ended."""
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
            self._keys.difference_update(key for _run, key, _apply in out)
            return out

    def wait_idle(self) -> None:
        """Block until nothing is queued or being hashed."""
        with self._lock:
            self._lock.wait_for(lambda: not self._pending)

    def close(self) -> None:
        for _ in self._threads:
            self._ready.put(None)

    def _serve(self) -> None:
        while (item := self._ready.get()) is not None:
            run, key, work, _size = item
            batch = [(key, _run(work))]
            began = time.monotonic()
            while len(batch) < self._batch and time.monotonic() - began < self._batch_seconds:
                with self._lock:
                    lane = self._lanes[run]
                    if not lane or not self._ready.empty():  # another lane waits: its turn
                        break
                    if self._batch_bytes is not None and lane[0][2] > self._batch_bytes:
                        break  # long to hash: what this batch hashed is recorded first
                    key, work, _size = lane.popleft()
                batch.append((key, _run(work)))
            applies = self._recorded([result for _key, result in batch])
            with self._lock:
                self._finished.extend((run, key, apply) for (key, _r), apply in zip(batch, applies, strict=True))
                self._pending -= len(batch)
                lane = self._lanes[run]
                if lane:  # the lane's next, behind the other lanes' work already waiting
                    self._ready.put((run, *lane.popleft()))
                else:
                    del self._lanes[run]
                self._lock.notify_all()
            self._done(run)

    def _recorded(self, results: list[Apply | Staged]) -> list[Apply]:
        """``results`` with the staged ones recorded, together (an error recording them is each one's)."""
        staged = [r.item for r in results if isinstance(r, Staged)]
        if not staged:
            return [r for r in results if not isinstance(r, Staged)]
        try:
            recorded = iter(self._record(staged))
        except BaseException as exc:
            recorded = iter([raising(exc)] * len(staged))
        return [next(recorded) if isinstance(r, Staged) else r for r in results]


def _run(work: Work) -> Apply | Staged:
    try:
        return work()
    except BaseException as exc:  # the watcher reports it against the entry, on its thread
        return raising(exc)
