"""Dramatiq entry point: ``dramatiq pipeline.tasks``.

Importing this package installs the broker from the settings first, then declares the
actors (STACK_NOTES: ``set_broker`` before any actor). Nothing else imports it at module
level: importing ``pipeline`` starts nothing.
"""
from pipeline import settings as _settings
from pipeline.tasks.broker import install as _install

broker = _install(_settings.current())

from pipeline.tasks import actors  # noqa: E402,F401  (declares the actors on that broker)

if not _settings.current().broker_url.startswith("stub://"):
    # Every entry point brings the control plane to the newest schema.
    import logging as _logging

    from pipeline.db.migrate import upgrade as _upgrade

    _logging.getLogger("alembic").setLevel(_logging.WARNING)

    _upgrade(_settings.current().db_url)
