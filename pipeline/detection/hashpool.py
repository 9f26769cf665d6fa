"""Hashing off the scan thread, one lane per run (docs/design.md, "Bounded detection work").

The watcher's scan finds a checkpoint complete in the time of a few header reads; hashing it
takes as long as reading every byte. So the scan hands each complete checkpoint to this pool
and goes on with the other runs. Each run is a lane: its checkpoints are hashed one at a
time, in the order found; the lanes are served in turn by ``threads`` threads (a lane's next
checkpoint queues behind the other lanes' first). One run thus holds at most one thread: a
big checkpoint in one run never delays another run's while fewer than ``threads`` runs are
hashing at once.

A piece of work runs on a pool thread and returns what to change in the watcher's own state,
a function that the watcher applies on its thread (:meth:`finished`); an exception it raises
is re-raised there. Threads are daemons: stopping the watcher does not wait for a hash (what
was not recorded is found again at the next start).
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

#: What a piece of work changes in the watcher, applied on its thread; returns seconds until the
#: entry needs a new look, or None.
Apply = Callable[[], float | None]
Work = Callable[[], Apply]


def _raising(exc: BaseException) -> Apply:
    def apply() -> None:
        raise exc
    return apply


class HashPool:
    """``threads`` threads hashing the checkpoints the scan hands over, each run in its own lane."""

    def __init__(self, threads: int, *, done: Callable[[str], None] = lambda run: None) -> None:
        """``done(run)`` is called (on a pool thread) each time work of ``run`` ends."""
        self._done = done
        self._lock = threading.Condition()
        self._lanes: dict[str, deque[tuple[str, Work]]] = {}  # run -> its work not started yet
        self._keys: set[str] = set()       # queued, being hashed, or done and not yet applied
        self._pending = 0                  # queued or being hashed
        self._ready: queue.SimpleQueue[tuple[str, str, Work] | None] = queue.SimpleQueue()
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

    def submit(self, run: str, key: str, work: Work) -> None:
        """Hash ``key`` of ``run`` by ``work``, after the lane's earlier work; once at a time per key."""
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
            self._pending += 1
            lane = self._lanes.get(run)
            if lane is None:  # an idle lane: straight to the threads
                self._lanes[run] = deque()
                self._ready.put((run, key, work))
            else:
                lane.append((key, work))

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
            run, key, work = item
            try:
                apply = work()
            except BaseException as exc:  # the watcher reports it against the entry, on its thread
                apply = _raising(exc)
            with self._lock:
                self._finished.append((run, key, apply))
                self._pending -= 1
                lane = self._lanes[run]
                if lane:  # the lane's next, behind the other lanes' work already waiting
                    self._ready.put((run, *lane.popleft()))
                else:
                    del self._lanes[run]
                self._lock.notify_all()
            self._done(run)
