"""Cross-cutting behaviour of the actors, as Dramatiq middleware."""
from __future__ import annotations

import logging
import threading
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Middleware, SkipMessage

log = logging.getLogger("ckpt.tasks")


class JobFailures(Middleware):
    """Records each failed attempt on its job, and marks the job ``failed`` when Dramatiq
    gives the message up (retries exhausted or attempts counted out): the message then
    sits in the dead-letter queue, the job row says why.
    """

    def after_process_message(self, broker: Broker, message: MessageProxy, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        if exception is None:
            return
        from pipeline import settings as settings_mod
        from pipeline.tasks.failures import record_failure

        try:
            record_failure(settings_mod.current(), message.actor_name, message.args, exception,
                           final=bool(getattr(message, "failed", False)))
        except Exception:  # never let bookkeeping break the worker
            log.exception("could not record the failure of %s%r", message.actor_name, message.args)


class Ready(Middleware):
    """Says that a worker process booted (pipeline.service.readiness), for ``ckpt up``."""

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        from pipeline import settings as settings_mod
        from pipeline.service.readiness import mark_ready

        mark_ready(settings_mod.current(), "dramatiq")


class CodecWarmth(Middleware):
    """Loads the planes codec as a worker process boots where frames are coming (its storage
    workers are on other hosts; pipeline/service/warmth.py), not inside the first store. Added
    after :class:`Ready` and before :class:`ConsumerBeat` (``after_worker_boot`` runs the
    middleware in reverse): after the first beat (the host's queue is seen consumed without
    waiting for it), before the process counts as booted."""

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        from pipeline import settings as settings_mod
        from pipeline.service.warmth import warm_codec

        warm_codec(settings_mod.current())


class Failpoints(Middleware):
    """Names the commit failpoints of each message after its actor (tests only:
    installed when ``CKPT_FAILPOINTS`` is set, see :mod:`pipeline.failpoints`)."""

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        from pipeline import failpoints

        failpoints.begin_message(message.actor_name)

    def after_process_message(self, broker: Broker, message: MessageProxy, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        from pipeline import failpoints

        failpoints.end_message()

    after_skip_message = after_process_message


class Deliveries(Middleware):
    """Drops a stale delivery before it does any work (pipeline/deliveries.py): another
    message was sent for its step since. It counts no attempt and leaves no dead letter.
    Also tells the step which message it runs, so it may send its own step again."""

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        from pipeline import deliveries
        from pipeline import settings as settings_mod
        from pipeline.db.engine import session_scope
        from pipeline.tasks.waiting import release

        deliveries.CURRENT.set(message.message_id)
        release(broker, message)
        if message.actor_name not in deliveries.KEYED or not message.args:
            return
        with session_scope(settings_mod.current().db_url, readonly=True) as s:
            current = deliveries.is_current(s, message.actor_name, message.args, message.message_id)
        if not current:
            log.info("%s%r: stale delivery %s (another message was sent for its step); dropped",
                     message.actor_name, tuple(message.args), message.message_id)
            raise SkipMessage(f"stale delivery {message.message_id}")

    def after_process_message(self, broker: Broker, message: MessageProxy, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        from pipeline import deliveries

        deliveries.CURRENT.set(None)

    after_skip_message = after_process_message


class ConsumerBeat(Middleware):
    """Says, every ``consumer_beat_seconds``, which queues this worker process consumes
    (pipeline/consumers.py): a host whose queue has no beat is down, nothing is sent to it, and
    a restore is not routed there. The first beat is written before the process counts as
    booted (added after :class:`Ready`: ``after_worker_boot`` runs the middleware in reverse).
    A process serving its host's queue also reports the host in, with its hostname as label."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        from pipeline import settings as settings_mod

        settings = settings_mod.current()

        def run() -> None:
            while not self.stop.wait(settings.consumer_beat_seconds):
                self.beat(settings, worker)

        self.beat(settings, worker)
        self.thread = threading.Thread(target=run, name="ckpt-consumer-beat", daemon=True)
        self.thread.start()

    @staticmethod
    def beat(settings: Any, worker: Any) -> None:
        from pipeline import consumers
        from pipeline.db import hosts
        from pipeline.db.engine import session_scope
        from pipeline.hostid import host_queue

        queues = [q for q in list(worker.consumers) if not q.endswith(".DQ")]
        try:
            with session_scope(settings.db_url) as s:
                consumers.beat(s, settings.host_id, queues)
                if host_queue(settings.host_id) in queues:
                    hosts.report_in(s, settings.host_id, settings.host_label)
        except Exception as exc:  # the control plane is away: the next beat tries again
            log.warning("could not say which queues this worker consumes: %s", exc)

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        self.stop.set()
