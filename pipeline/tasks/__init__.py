"""Dramatiq entry point: ``dramatiq pipeline.tasks``.

Importing this package installs the broker from the settings first, then declares the
actors (an actor declared before ``set_broker`` would bind to a default RabbitMQ broker).
Nothing else imports it at module level: importing ``pipeline`` starts nothing. It does not
touch the database: the entry points (``ckpt up``, ``ckpt migrate``, the other ``ckpt``
commands) bring the schema to head.
"""
from pipeline import settings as _settings
from pipeline.service.lifetime import bind_dramatiq_worker_to_master as _bind
from pipeline.tasks.broker import install as _install

_bind()  # a worker process dies with its dramatiq master (pipeline/service/lifetime.py)

broker = _install(_settings.current())

from pipeline.hostid import host_queue as _host_queue  # noqa: E402

# This host's own queue: the steps that touch its local files (pipeline/queues.py).
broker.declare_queue(_host_queue(_settings.current().host_id))

from pipeline.tasks import actors  # noqa: E402,F401  (declares the actors on that broker)
