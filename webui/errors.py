"""Errors of the web UI: JSON with a reason for the API, a page for browsers."""
from __future__ import annotations

from flask import Flask, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from pipeline.errors import (CkptError, ConfigError, HeaderError, IncompleteCheckpoint, InvalidTransition,
                             OutsideRoots, RestoreError, SourceChanged, UnknownCheckpoint, UnknownJob)


class ApiError(Exception):
    """Raised by a view to answer with ``status`` and a JSON reason."""

    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason
        super().__init__(reason)


def status_of(exc: CkptError) -> int:
    """The HTTP status a pipeline error deserves."""
    if isinstance(exc, (UnknownCheckpoint, UnknownJob)):
        return 404
    if isinstance(exc, (InvalidTransition, SourceChanged)):
        return 409
    if isinstance(exc, RestoreError) and "already exists" in str(exc):
        return 409
    if isinstance(exc, (OutsideRoots, HeaderError, IncompleteCheckpoint, RestoreError, ConfigError)):
        return 400
    return 400


def wants_json() -> bool:
    return request.path.startswith("/api/") or request.path == "/metrics"


def register(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api(exc: ApiError):  # noqa: ANN202
        return jsonify(error=exc.reason, status=exc.status), exc.status

    @app.errorhandler(CkptError)
    def _ckpt(exc: CkptError):  # noqa: ANN202
        code = status_of(exc)
        if wants_json():
            return jsonify(error=str(exc), status=code), code
        return render_template("error.html", code=code, message=str(exc)), code

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):  # noqa: ANN202
        if wants_json():
            return jsonify(error=exc.description, status=exc.code), exc.code
        return render_template("error.html", code=exc.code, message=exc.description), exc.code
