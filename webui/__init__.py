"""The Flask web UI and JSON API (``create_app``), served by ``ckpt up`` and ``ckpt web``."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from flask import Flask
from flask.json.provider import DefaultJSONProvider
from markupsafe import Markup

from pipeline import settings as settings_mod
from pipeline.status import iso


def create_app(test_config: dict[str, Any] | None = None, settings: settings_mod.Settings | None = None) -> Flask:
    """Build the app on ``settings`` (default: the process settings).

    The broker is installed from the same settings, so actions enqueue where workers listen.
    """
    s = settings_mod.configure(settings) if settings is not None else settings_mod.current()
    import pipeline.tasks  # noqa: F401  (installs the broker; `ckpt web` and `ckpt up` upgrade the schema)

    app = Flask(__name__)
    app.json = _Json(app)
    app.config.from_mapping(
        SECRET_KEY=s.secret("web.secret").decode(),
        ADMIN_TOKEN=s.admin_token(),
        CKPT_SETTINGS=s,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
    )
    if test_config:
        app.config.update(test_config)

    from webui import api, auth, errors, incidents, metrics, pages
    from webui.security import csrf_token

    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(auth.bp)
    app.register_blueprint(metrics.bp)
    app.register_blueprint(incidents.bp)
    errors.register(app)
    app.jinja_env.globals["csrf_token"] = csrf_token
    app.jinja_env.filters["bytes"] = _bytes
    app.jinja_env.filters["when"] = _when
    app.jinja_env.filters["seconds"] = _seconds
    app.jinja_env.filters["runname"] = _runname
    return app


class _Json(DefaultJSONProvider):
    """The API's JSON: keys in the order the code builds them, times as ISO 8601 in UTC."""

    sort_keys = False

    @staticmethod
    def default(o: Any) -> Any:
        return iso(o) if isinstance(o, datetime) else DefaultJSONProvider.default(o)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1000
    return f"{value:,.1f} TB"


def _when(t: datetime | None) -> Markup | str:
    """A time: UTC in the page, shown in the browser's time zone by live.js."""
    if t is None:
        return "-"
    return Markup('<time datetime="{}">{}</time>').format(iso(t), t.strftime("%Y-%m-%d %H:%M:%S UTC"))


def _runname(run: str) -> str:
    """A run as people name it: its last two path parts (``runs/llama-7b``)."""
    return "/".join(run.rstrip("/").split("/")[-2:])


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:,.1f} s" if s < 120 else f"{s / 60:,.1f} min"
