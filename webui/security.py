"""Who may change things: the admin token, the login session and CSRF tokens.

GET never mutates. A mutating API request carries ``Authorization: Bearer <admin token>``
(401 without it, 403 with a wrong one). A mutating form needs a logged-in session (the
admin token entered once on /login) and the session's CSRF token in the form.
"""
from __future__ import annotations

import functools
import hmac
import secrets
from collections.abc import Callable
from typing import Any

from flask import abort, current_app, redirect, request, session, url_for

from webui.errors import ApiError


def token_matches(candidate: str | None) -> bool:
    expected = current_app.config["ADMIN_TOKEN"]
    return bool(candidate) and hmac.compare_digest(str(candidate), expected)


def csrf_token() -> str:
    token = session.get("csrf")
    if not token:
        token = session["csrf"] = secrets.token_urlsafe(32)
    return token


def check_csrf() -> None:
    sent = request.form.get("csrf_token", "")
    if not sent or not hmac.compare_digest(sent, session.get("csrf", "")):
        abort(403, description="the form's CSRF token is missing or stale; reload the page and try again")


def api_admin(view: Callable[..., Any]) -> Callable[..., Any]:
    """Mutating API endpoint: the admin token as a bearer token."""

    @functools.wraps(view)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            raise ApiError(401, "this endpoint needs `Authorization: Bearer <admin token>` "
                                "(the token is in <home>/admin.token and printed by `ckpt up`)")
        if not token_matches(header[len("Bearer "):].strip()):
            raise ApiError(403, "the admin token is wrong")
        return view(*args, **kwargs)

    return wrapped


def form_admin(view: Callable[..., Any]) -> Callable[..., Any]:
    """Mutating form: a logged-in session and a valid CSRF token."""

    @functools.wraps(view)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not session.get("admin"):
            if request.method == "GET":
                return redirect(url_for("auth.login", next=request.path))
            abort(401, description="log in with the admin token first")
        if request.method == "POST":
            check_csrf()
        return view(*args, **kwargs)

    return wrapped
