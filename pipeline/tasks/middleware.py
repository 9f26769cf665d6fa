"""Cross-cutting behaviour of the actors, as Dramatiq middleware."""
from __future__ import annotations

import logging
import threading
from typing import Any

from dramatiq import Broker
from dramatiq.broker import MessageProxy
from dramatiq.middleware import Middleware

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


class ConsumerBeat(Middleware):
    """Says, every few seconds, that this worker process consumes its host's queue
    (``hosts.consumer_seen``, pipeline/db/hosts.py): a restore is sent to a host only while
    something there will run it. The first beat is written before the process counts as
    booted (added after :class:`Ready`: ``after_worker_boot`` runs the middleware in reverse)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def after_worker_boot(self, broker: Broker, worker: Any) -> None:
        from pipeline import settings as settings_mod
        from pipeline.queues import host_queue

        settings = settings_mod.current()
        if host_queue(settings.host_id) not in getattr(worker, "consumers", {}):
            return  # this process serves only the shared queue: it says nothing for the host
        self.beat(settings)
        self.thread = threading.Thread(target=self._run, args=(settings,), name="ckpt-consumer-beat", daemon=True)
        self.thread.start()

    def before_worker_shutdown(self, broker: Broker, worker: Any) -> None:
        self.stop.set()

    def _run(self, settings: Any) -> None:
        from pipeline.db.hosts import CONSUMER_BEAT_SECONDS

        while not self.stop.wait(CONSUMER_BEAT_SECONDS):
            self.beat(settings)

    @staticmethod
    def beat(settings: Any) -> None:
        from pipeline.db import hosts
        from pipeline.db.engine import session_scope

        try:
            with session_scope(settings.db_url) as s:
                hosts.report_in(s, settings.host_id, settings.host_label, consumer=True)
        except Exception as exc:  # the control plane is unreachable: said again at the next beat
            log.warning("could not say that this host's queue is consumed: %s", exc)


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
