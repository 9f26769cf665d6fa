"""Serving a WSGI app with gunicorn's threaded workers (never the werkzeug dev server).

gthread workers keep long responses alive (uploads, shard downloads, server-sent events)
and serve other requests meanwhile; the sync worker would cut a stream at its timeout.
"""
from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication


class _Gunicorn(BaseApplication):
    def __init__(self, app: Any, options: dict[str, Any]) -> None:
        self.application, self.options = app, options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        return self.application


def run(app: Any, *, host: str, port: int, threads: int, name: str, **options: Any) -> None:
    """Serve ``app`` on ``host:port`` in the foreground until SIGTERM/SIGINT."""
    config = {
        "bind": f"{host}:{port}",
        "workers": 1,
        "worker_class": "gthread",
        "threads": threads,
        # Long transfers and streams are fine: the gthread worker heartbeats from its
        # main loop, so this only bounds a hung worker.
        "timeout": 120,
        "graceful_timeout": 10,
        "keepalive": 75,
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "warning",
        "proc_name": name,
        "sendfile": True,
    }
    config.update(options)
    _Gunicorn(app, config).run()
