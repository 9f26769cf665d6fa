"""Cross-cutting behaviour of the actors, as Dramatiq middleware."""
from __future__ import annotations

import logging
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
