"""Uploads that start while detection is still hashing (docs/design.md, "Sent while hashing").

Detection hashes a checkpoint's files and their shards (pipeline.hashing); a shard's SHA-256
is known as soon as its bytes have been read, long before the file's. As each of the first
few new contents (``AHEAD`` messages) is, it is referenced (created live, or touched: the garbage
collector's grace period keeps it until the checkpoint is recorded), placed on RF workers
and its copies sent, the message naming the shard's place in the file (no checkpoint row
names the file yet). The trainer's link starts working after the first changed shard is
hashed instead of after the last; on a slow link that hashing costs nothing but the first
shard's.

Nothing in this is trusted more than any upload: each worker hashes what it receives and
refuses bytes that do not match before they are visible (invariant 4), and a copy counts
only once re-hashed from its disk. A file that changes while it is hashed is not recorded;
the contents sent for it are referenced by nothing and collected after the grace period.
The shard step then places and sends the rest (and what this could not: a placement that
failed, a send that could not be queued); ``Send("shard", (job_id, sent))`` names the copies
sent here.

A shard whose content already has RF copies placed on counting workers (an unchanged shard;
the rule of ``place``) costs one read, and the watcher has its verified copies re-hashed on
their workers at once, in a thread, counted from when the hashing began (the shard step's
recheck would start only once it is recorded).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select

from pipeline import failpoints
from pipeline.core.placement import ChainBalance
from pipeline.core.planner import ShardPlan
from pipeline.db.copies import place, placed_count
from pipeline.db.engine import session_scope
from pipeline.db.models import Content, ContentCopy
from pipeline.detection.catalog import reference
from pipeline.detection.completeness import FileEntry
from pipeline.errors import PlacementError
from pipeline.settings import Settings
from pipeline.states import CopyState
from pipeline.steps import Send
from pipeline.store.replication import again
from pipeline.store.sharding import revive
from pipeline.store.verification import recheck_contents

log = logging.getLogger("ckpt.early")

#: Messages in flight while hashing, at most (a chain is one per content, fan-out RF). Hashing
#: is faster than any link, so a few keep the link busy until the shard step sends the rest;
#: and they leave threads of a Dramatiq process (four) free, so that the shard step's
#: message, queued behind them, runs at once instead of after the last upload (measured:
#: with every shard sent early, a 1 GB store became ``sharded`` only 7.5 s after it was
#: recorded at 1 Gbit; with three fan-out contents, six messages, 11 s at 100 Mbit). One that
#: ends while hashing goes on is followed by the next new content found (on a fast link the
#: first three were done in a second and the link then idled until the shard step).
AHEAD = 3
#: How often, while hashing goes on, the uploads sent here are looked at for one that ended.
POLL_SECONDS = 0.05


def worth_it(settings: Settings, total_bytes: int) -> bool:
    """Whether a checkpoint of ``total_bytes`` gains by sending while it is hashed: not when it
    fits in one shard. Its hashing (one shard's, ~30 ms at 64 MiB) ends about when its first
    shard's would, so its uploads could start only that much sooner, while each content sent
    here costs the detection lane two transactions and a thread (at 1 MiB saves, 40 % of
    detection's CPU): the shard step, queued at once, places and sends them all together."""
    return total_bytes > settings.shard_size


class EarlySends:
    """The uploads of one checkpoint's shards, started one by one while detection hashes it.

    Used as a context manager around the hashing, it sends the next new content whenever an
    upload it sent has ended (no copy of that message is pending any more), at most ``AHEAD``
    messages in flight; :attr:`sent` is final once it has exited."""

    def __init__(self, settings: Settings, send: Callable[[list[Send]], object], mode: str,
                 started: datetime | None = None, *, rf: int | None = None, total_bytes: int | None = None) -> None:
        self.settings, self.send, self.mode = settings, send, mode
        #: Whether anything is sent here: not for a checkpoint of ``total_bytes`` that fits in one
        #: shard (worth_it), whose hashing ends as soon as its first shard's would.
        self.active = total_bytes is None or worth_it(settings, total_bytes)
        #: the workers' RF of the checkpoint's run (``Settings.rf_for``); the global one if not given
        self.rf = settings.rf if rf is None else rf
        #: when the store's hashing began: given, the copies of the unchanged contents found are
        #: re-hashed on their workers meanwhile (counted from then: pipeline.store.verification)
        self.started = started
        self._unchanged: list[str] = []
        self._rechecking = False
        #: the copies whose messages were queued here (the shard step does not send them again)
        self.sent: list[int] = []
        self._chains = ChainBalance()
        self._stopped = False
        self._lock = threading.Lock()
        self._found: deque[tuple[FileEntry, ShardPlan, str]] = deque()  # hashed, not looked at yet
        self._in_flight: list[list[int]] = []  # the copies of each message sent, while one is pending
        self._done = threading.Event()
        self._watch: threading.Thread | None = None

    def __enter__(self) -> EarlySends:
        if not self.active:
            return self
        self._watch = threading.Thread(target=self._refill, name="ckpt-early", daemon=True)
        self._watch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._watch is not None:
            self._watch.join()

    @property
    def on_shard(self) -> Callable[[FileEntry, ShardPlan, str], None] | None:
        """What the hashing tells each shard it hashed (``catalog.hash_checkpoint``); None when inactive."""
        return self.shard if self.active else None

    def shard(self, entry: FileEntry, plan: ShardPlan, sha: str) -> None:
        """A shard of ``entry`` was hashed: place its content and send its new copies (now, if
        fewer than ``AHEAD`` messages are in flight, else when one has ended)."""
        if self._stopped or not self.active:
            return
        try:
            with session_scope(self.settings.db_url) as s:
                placed = placed_count(s, sha)
        except Exception as exc:  # the control plane: detection goes on, the shard step sends
            log.warning("could not look up %s while hashing (%s); it is sent once recorded", sha[:12], exc)
            self._stopped = True
            return
        with self._lock:
            if placed >= self.rf:
                self._shared(sha)  # unchanged: a read, not a write per shard (the record references it)
            elif not self._stopped:
                self._found.append((entry, plan, sha))
                self._send_while_room()

    def _refill(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            with self._lock:
                if self._stopped:
                    return
                if self._found and len(self._in_flight) >= AHEAD:
                    try:
                        self._in_flight = self._pending(self._in_flight)
                    except Exception as exc:  # the control plane: the shard step sends the rest
                        log.warning("could not look at the uploads sent while hashing (%s); the rest is sent "
                                    "once recorded", exc)
                        self._stopped = True
                        return
                self._send_while_room()

    def _shared(self, sha: str) -> None:
        """An unchanged content: its verified copies are re-hashed from their disks now, in a
        thread of this process, rather than from the shard step's recheck once recorded (in
        the box at 1 Gbit that recheck could still be reading when the last upload ended)."""
        if self.started is None:
            return
        self._unchanged.append(sha)
        if not self._rechecking:
            self._rechecking = True
            threading.Thread(target=self._recheck, args=(self.started,), name="ckpt-early-recheck",
                             daemon=True).start()

    def _recheck(self, since: datetime) -> None:
        """Re-hash the unchanged contents found so far, batch after batch, until none is left.
        Best effort: what it does not reach, the shard step's recheck or the verify step does."""
        while True:
            with self._lock:
                batch, self._unchanged = self._unchanged, []
                if not batch:
                    self._rechecking = False
                    return
            try:
                recheck_contents(self.settings, batch, since)
            except Exception as exc:
                log.warning("could not re-hash the shared copies while hashing (%s); the store's recheck does", exc)
                with self._lock:
                    self._unchanged, self._rechecking = [], False
                return

    def _pending(self, messages: list[list[int]]) -> list[list[int]]:
        """The messages of which a copy is still pending (its upload has not ended)."""
        with session_scope(self.settings.db_url) as s:
            pending = set(s.scalars(select(ContentCopy.id).where(
                ContentCopy.id.in_([i for m in messages for i in m]), ContentCopy.state == CopyState.PENDING)))
        return [m for m in messages if pending.intersection(m)]

    def _send_while_room(self) -> None:
        while self._found and len(self._in_flight) < AHEAD and not self._stopped:
            self._send(*self._found.popleft())

    def _send(self, entry: FileEntry, plan: ShardPlan, sha: str) -> None:
        """Place the content of a hashed shard and queue the messages that send its new copies."""
        try:
            with session_scope(self.settings.db_url) as s:
                reference(s, {sha: plan.size})
                content = revive(s, [s.get_one(Content, sha)])[0]
                copies = [(c.id, c.worker_id) for c in place(s, content, self.rf)]
        except PlacementError:
            return  # too few workers now: the shard step says so, and waits
        except Exception as exc:  # the control plane: detection goes on, the shard step sends
            log.warning("could not start the upload of %s while hashing (%s); it is sent once recorded",
                        sha[:12], exc)
            self._stopped = True
            return
        if not copies:
            return  # placed meanwhile (the record references it)
        named: dict[str, Any] = {
            "host": self.settings.host_id, "path": entry.abspath, "size": entry.size, "mtime_ns": entry.mtime_ns,
            "kind": plan.kind, "tensors": list(plan.tensors), "offset": plan.src_offset, "length": plan.length,
        }
        by_worker = {w: cid for cid, w in copies}
        if self.mode == "chain":
            ids = [by_worker[w] for w in self._chains.order(plan.size, list(by_worker))]
            sends = [Send("replicate", (ids[0], ids[1:], named))]
        else:
            sends = [again(cid, named) for cid, _w in copies]
        try:
            self.send(sends)
        except Exception as exc:  # the broker: these copies stay pending and the shard step sends them
            log.warning("could not queue the upload of %s while hashing (%s); it is sent once recorded",
                        sha[:12], exc)
            self._stopped = True
            return
        self.sent += [cid for cid, _w in copies]
        self._in_flight += [[send.args[0], *send.args[1]] for send in sends]
        failpoints.hit("early.sent")  # queued; detection goes on hashing
