"""Log in with the admin token (for forms); log out."""
from __future__ import annotations

from flask import Blueprint, flash, redirect, render_template, request, session, url_for
from flask.typing import ResponseReturnValue

from webui.security import check_csrf, token_matches

bp = Blueprint("auth", __name__)


@bp.route("/login", methods=("GET", "POST"))
def login() -> ResponseReturnValue:
    if request.method == "POST":
        check_csrf()
        if not token_matches(request.form.get("token", "").strip()):
            flash("That is not the admin token (see <home>/admin.token, printed by `ckpt up`).", "error")
            return render_template("login.html"), 403
        session["admin"] = True
        target = request.args.get("next") or url_for("pages.overview")
        return redirect(target if target.startswith("/") and not target.startswith("//") else "/")
    return render_template("login.html")


@bp.route("/logout", methods=("POST",))
def logout() -> ResponseReturnValue:
    check_csrf()
    session.pop("admin", None)
    return redirect(url_for("pages.overview"))
