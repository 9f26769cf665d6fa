"""Errors of the web UI: JSON with a reason for the API, a page for browsers."""
from __future__ import annotations

from flask import Flask, jsonify, render_template, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from pipeline.errors import (
    CkptError,
    DestinationExists,
    InvalidTransition,
    NoConsumer,
    SourceChanged,
    UnknownCheckpoint,
    UnknownJob,
    UnknownRun,
)


class ApiError(Exception):
    """Raised by a view to answer with ``status`` and a JSON reason."""

    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason
        super().__init__(reason)


#: The HTTP status each kind of pipeline error deserves; the first match wins.
STATUS: tuple[tuple[type[CkptError], int], ...] = (
    (UnknownCheckpoint, 404),
    (UnknownJob, 404),
    (UnknownRun, 404),
    (InvalidTransition, 409),
    (SourceChanged, 409),
    (DestinationExists, 409),
    (NoConsumer, 409),  # nothing would run it there now: refused, not queued for ever
    (CkptError, 400),  # bad input: a path outside the roots, an incomplete checkpoint, a bad setting
)


def status_of(exc: CkptError) -> int:
    """The HTTP status a pipeline error deserves (:data:`STATUS`)."""
    return next(code for kind, code in STATUS if isinstance(exc, kind))


def wants_json() -> bool:
    return request.path.startswith("/api/") or request.path == "/metrics"


def register(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api(exc: ApiError) -> ResponseReturnValue:
        return jsonify(error=exc.reason, status=exc.status), exc.status

    @app.errorhandler(CkptError)
    def _ckpt(exc: CkptError) -> ResponseReturnValue:
        code = status_of(exc)
        if wants_json():
            return jsonify(error=str(exc), status=code), code
        return render_template("error.html", code=code, message=str(exc)), code

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> ResponseReturnValue:
        if wants_json():
            return jsonify(error=exc.description, status=exc.code), exc.code or 500
        return render_template("error.html", code=exc.code, message=exc.description), exc.code or 500
