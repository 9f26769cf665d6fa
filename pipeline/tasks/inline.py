"""Continuing a step's follow-ups in the thread that decided them (docs/design.md, "Continuing
in the same thread").

A step returns its follow-up messages once its transactions committed (invariant 3). A
follow-up it marks ``here`` (:class:`pipeline.steps.Send`: short work, such as the upload of a
checkpoint that fits in one shard, its verification, the rotations a rotation pass decides)
runs next in this thread when this process consumes the one queue it would be routed to
(pipeline/queues.py): the same step function its actor calls, the same transactions,
transitions and events, without the send's two transactions, the delivery's check and the
Redis round trips. Everything else is sent as always (pipeline/tasks/sending.py), and so is a
marked follow-up

- routed to a queue this process does not consume (another host's, or several);
- of a step already continuing in another thread of this process (sent: a request made while
  that one runs is not lost);
- beyond :data:`MAX_STEPS` continued in one message's thread.

A continuation that raises hands its step to the Dramatiq workers: its failure is recorded on
its jobs and its message sent (the retries and the attempts left go on there); one interrupted
(a time limit, a shutdown) sends the follow-ups not run yet too. A process killed during one
leaves its jobs to the scheduler's re-drive once their leases end, as a killed delivery does.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pipeline import failpoints
from pipeline import settings as settings_mod
from pipeline.db.engine import session_scope
from pipeline.queues import queues_for
from pipeline.steps import Send
from pipeline.tasks.failures import record_failure
from pipeline.tasks.sending import distinct, send_all

log = logging.getLogger("ckpt.tasks")

#: At most this many steps continue in the thread of one message; the rest are sent.
MAX_STEPS = 16

#: The Dramatiq worker of this process, once it booted (:func:`serve`): its consumers name the
#: queues this process takes messages from. None (a scheduler, a watcher, a unit test's stub
#: worker): nothing continues here, everything is sent.
_worker: Any = None
_running: set[tuple[str, str]] = set()
_lock = threading.Lock()

Step = Callable[[Send], list[Send]]


def serve(worker: Any) -> None:
    """Continue marked follow-ups in this process, which ``worker`` consumes queues for."""
    global _worker
    _worker = worker


def consumed() -> frozenset[str]:
    """The queues this process's Dramatiq worker consumes (none before it booted)."""
    worker = _worker
    return frozenset(q for q in list(getattr(worker, "consumers", None) or ()) if not q.endswith(".DQ"))


def carry_on(sends: list[Send], steps: dict[str, Step]) -> None:
    """Send ``sends``, except those marked ``here`` whose actor has a step in ``steps`` and whose
    queue this process consumes: those run now, one after the other, and so do the follow-ups
    they mark in turn, up to :data:`MAX_STEPS`."""
    todo = deque(_split(sends, steps))
    done = 0
    while todo:
        item = todo.popleft()
        if done >= MAX_STEPS:
            send_all([item, *todo])
            return
        done += 1
        with failpoints.as_message(item.actor), _claimed(item) as mine:
            if not mine:  # running in another thread here: asked again, so sent
                send_all([item])
                continue
            try:
                follow = steps[item.actor](item)
            except BaseException as exc:
                _hand_over(item, exc, list(todo) if not isinstance(exc, Exception) else [])
                if not isinstance(exc, Exception):
                    raise
                continue
            todo.extend(_split(follow, steps))


def _split(sends: list[Send], steps: dict[str, Step]) -> list[Send]:
    """Send those of ``sends`` that do not continue here; the ones that do."""
    sends = distinct(sends)
    ours = consumed()
    marked = [i for i, item in enumerate(sends) if item.here and item.actor in steps]
    here: set[int] = set()
    if ours and marked:
        with session_scope(settings_mod.current().db_url, readonly=True) as s:
            for i in marked:
                queues = queues_for(s, sends[i])
                if len(queues) == 1 and queues[0] in ours:
                    here.add(i)
    send_all([item for i, item in enumerate(sends) if i not in here])
    return [item for i, item in enumerate(sends) if i in here]


@contextmanager
def _claimed(item: Send) -> Iterator[bool]:
    """Whether this thread runs ``item`` (no other thread of this process is running it)."""
    name = (item.actor, repr(item.args))
    with _lock:
        mine = name not in _running
        _running.add(name)
    try:
        yield mine
    finally:
        if mine:
            with _lock:
                _running.discard(name)


def _hand_over(item: Send, exc: BaseException, rest: list[Send]) -> None:
    """A continuation failed: its jobs say why, its message goes to the workers (with ``rest``,
    the continuations an interruption leaves)."""
    log.warning("%s%r, continued in this thread, failed (%s: %s); sent to the workers", item.actor,
                tuple(item.args), type(exc).__name__, exc)
    try:
        record_failure(settings_mod.current(), item.actor, item.args, exc, final=False)
    finally:
        send_all([item, *rest])
