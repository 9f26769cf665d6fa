"""Alerts in the web UI: the banner every page shows (``active_alerts``), the incidents page
(what was found, when, what repaired it) and ``GET /api/alerts``. Read from the ``alerts`` rows
the scheduler keeps (pipeline/alerts.py): a page never runs the conditions' queries itself."""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from flask import Blueprint, current_app, jsonify, render_template, request
from flask.typing import ResponseReturnValue

from pipeline import alerts
from pipeline.db.transitions import now
from webui import data

log = logging.getLogger("ckpt.web")
bp = Blueprint("incidents", __name__)


def stale_after(settings: Any) -> float:
    """Alerts evaluated longer ago than this are stale: the scheduler sweeps every ten ticks."""
    return max(120.0, settings.tick_seconds * 10 * 3)


@bp.app_template_global()
def active_alerts() -> dict[str, Any] | None:
    """What the banner shows: the open alerts that fired, and whether they are stale (the
    scheduler has not evaluated them lately); None when the control plane cannot say."""
    s = current_app.config["CKPT_SETTINGS"]
    try:
        doc = alerts.active(s)
    except Exception:  # the page itself says what is wrong; the banner never breaks it
        log.warning("could not read the alerts for the banner", exc_info=True)
        return None
    evaluated = doc["evaluated_at"]
    doc["stale"] = evaluated is not None and now() - evaluated > timedelta(seconds=stale_after(s))
    return doc


@bp.route("/incidents")
def incidents() -> ResponseReturnValue:
    number = max(0, request.args.get("page", 0, type=int))
    items, more = data.paged(alerts.incidents(current_app.config["CKPT_SETTINGS"]), number)
    return render_template("incidents.html", items=items, page=number, more=more)


@bp.get("/api/alerts")
def api_alerts() -> ResponseReturnValue:
    """The open alerts that fired, when they were last evaluated, and the incidents' history."""
    s = current_app.config["CKPT_SETTINGS"]
    return jsonify(alerts.active(s) | {"incidents": alerts.incidents(s)})
