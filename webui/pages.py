"""The server-rendered pages: overview, checkpoints, shard health, jobs, workers, dead letters, actions."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    jsonify,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from markupsafe import Markup

from pipeline import operations, states
from pipeline.errors import CkptError, RestoreError, UnknownCheckpoint
from pipeline.settings import Settings
from pipeline.tasks import deadletters
from webui import bulk as bulk_mod
from webui import data, sorting, streams
from webui.charts import capacity_chart, protection_chart, throughput_chart
from webui.errors import status_of
from webui.security import form_admin

bp = Blueprint("pages", __name__)

#: A job's event stream writes at least this often, so that a page that has gone is noticed.
HEARTBEAT_SECONDS = 2.0


def settings() -> Settings:
    return current_app.config["CKPT_SETTINGS"]


def dead_letter_count() -> int:
    try:
        return len(deadletters.list_letters(settings()))
    except Exception:
        return -1


@bp.route("/")
def overview() -> ResponseReturnValue:
    doc = data.overview(settings(), dead_letter_count())
    return render_template("overview.html", o=doc, chart=Markup(throughput_chart(doc["transfers"])),
                           protection_chart=Markup(protection_chart(doc["transfers"])),
                           capacity_chart=Markup(capacity_chart(doc["capacity_history"], doc["capacity"]["limit"])))


@bp.route("/checkpoints")
def checkpoints() -> ResponseReturnValue:
    state, run = request.args.get("state") or None, request.args.get("run") or None
    q = request.args.get("q", "").strip() or None
    items, sort, number, more = sorting.listing(
        lambda **page: data.checkpoints(settings(), state=state, run=run, search=q, **page), sorting.CHECKPOINTS)
    return render_template("checkpoints.html", items=items, runs=data.runs(settings()), state=state, run=run, q=q,
                           states=sorted(states.all_states("store")), now=data.now(), sort=sort, page=number,
                           more=more, older=items[-1]["id"] if more and not sort.key else None)


@bp.route("/runs")
def run() -> ResponseReturnValue:
    """One run (``?name=``; a run is a directory path, kept out of the URL's path): its
    summary and its checkpoints by step, newest first, with search, a state filter and pages."""
    name = request.args.get("name") or ""
    state, q = request.args.get("state") or None, request.args.get("q", "").strip() or None
    number = max(0, request.args.get("page", 0, type=int))
    sort = sorting.requested(sorting.RUN)
    doc = data.run(settings(), name, state=state, search=q, page=number, order=sort.order(sorting.RUN))
    return render_template("run.html", r=doc, name=name, state=state, q=q, page=number, now=data.now(),
                           states=sorted(states.all_states("store")), sort=sort)


@bp.route("/checkpoints/<int:checkpoint_id>")
def checkpoint(checkpoint_id: int) -> ResponseReturnValue:
    return render_template("checkpoint.html", c=data.checkpoint(settings(), checkpoint_id))


@bp.route("/checkpoints/<int:checkpoint_id>/<any(pin, unpin, forget):action>", methods=("POST",))
@form_admin
def checkpoint_retention(checkpoint_id: int, action: str) -> ResponseReturnValue:
    """Pin (with the form's note), unpin or forget one checkpoint, then show it again."""
    try:
        if action == "forget":
            operations.forget(settings(), [str(checkpoint_id)])
            flash("forgotten: it can no longer be restored; once its remote copies are collected, its local copy "
                  "(if any) is the only one, and the local policy rotates it like any other", "info")
        else:
            note = request.form.get("note", "").strip() or None
            operations.pin(settings(), str(checkpoint_id), note, pinned=action == "pin")
            flash("pinned: the remote retention policy never forgets it" if action == "pin" else "unpinned", "info")
    except UnknownCheckpoint:
        raise
    except CkptError as e:  # shown where it was asked, in the page's words
        flash(str(e), "error")
    return redirect(url_for("pages.checkpoint", checkpoint_id=checkpoint_id), code=303)


@bp.route("/checkpoints/bulk", methods=("POST",))
@form_admin
def bulk() -> ResponseReturnValue:
    """Pin, unpin or forget the checked checkpoints: first a page saying what would happen to
    each (nothing changed), then, confirmed there, each done or refused on its own."""
    action, note = request.form.get("action", ""), request.form.get("note", "").strip() or None
    back = request.form.get("next", "")
    back = back if back.startswith("/") and not back.startswith("//") else url_for("pages.checkpoints")
    ids = [int(i) for i in request.form.getlist("id") if i.isdigit()]
    if action not in bulk_mod.ACTIONS:
        abort(400, description=f"unknown action {action!r}: pin, unpin or forget")
    if not ids:
        flash("check the checkpoints to " + action + " first", "error")
        return redirect(back, code=303)
    confirmed = request.form.get("confirm") == "1"
    outcomes = bulk_mod.run(settings(), action, ids, note=note, dry_run=not confirmed)
    return render_template("bulk.html", action=action, note=note, back=back, outcomes=outcomes, done=confirmed,
                           last_copy=bulk_mod.last_copy(settings()))


def chosen_host() -> str | None:
    """The host a restore form chose (its selector lists the hosts with a running consumer)."""
    return request.form.get("host", "").strip() or None


@bp.app_template_global()
def restore_hosts(preferred: str | None = None) -> dict[str, Any]:
    """What a restore form's host selector offers: the hosts with a running consumer, and the
    one selected (``preferred``, else this host, else the first)."""
    live = [h for h in data.hosts(settings()) if h["consumer_live"]]
    ids = [h["id"] for h in live]
    selected = next((h for h in (preferred, settings().host_id) if h in ids), ids[0] if ids else None)
    return {"hosts": live, "selected": selected}


@bp.route("/checkpoints/<int:checkpoint_id>/restore", methods=("POST",))
@form_admin
def checkpoint_restore(checkpoint_id: int) -> ResponseReturnValue:
    """Restore from the checkpoint's page; a refusal is shown in that form, with what was typed."""
    dest, overwrite = request.form.get("dest", "").strip(), request.form.get("overwrite") == "on"
    try:
        if not dest:
            raise RestoreError("give the destination: a path that does not exist yet, under a restore root")
        r = operations.restore_to(settings(), str(checkpoint_id), dest, overwrite=overwrite, host=chosen_host())
    except UnknownCheckpoint:
        raise
    except CkptError as e:
        c = data.checkpoint(settings(), checkpoint_id)
        return render_template("checkpoint.html", c=c, restore_error=str(e), dest=dest, overwrite=overwrite,
                               host=chosen_host()), \
            status_of(e)
    return redirect(url_for("pages.job", job_id=r.job_id), code=303)


@bp.route("/checkpoints/<int:checkpoint_id>/restore-check")
@form_admin
def checkpoint_restore_check(checkpoint_id: int) -> ResponseReturnValue:
    """Whether a restore to ``dest`` may go ahead (the form asks as it is typed)."""
    dest = request.args.get("dest", "").strip()
    try:
        if not dest:
            raise RestoreError("give the destination: a path that does not exist yet, under a restore root")
        target = operations.check_restore(settings(), str(checkpoint_id), dest,
                                          overwrite=request.args.get("overwrite") == "1",
                                          host=request.args.get("host") or None)
    except UnknownCheckpoint:
        raise
    except CkptError as e:
        return jsonify(ok=False, error=str(e))
    return jsonify(ok=True, target=str(target))


@bp.route("/health")
def health() -> ResponseReturnValue:
    problems = request.args.get("problems") == "1"
    h = data.health(settings(), problems_only=problems, before=request.args.get("before", type=int))
    return render_template("health.html", h=h, problems=problems)


@bp.route("/jobs")
def jobs() -> ResponseReturnValue:
    state, kind = request.args.get("state") or None, request.args.get("kind") or None
    q = request.args.get("q", "").strip() or None
    items, sort, number, more = sorting.listing(
        lambda **page: data.jobs(settings(), state=state, kind=kind, search=q, **page), sorting.JOBS)
    every = sorted({st for edges in states.TRANSITIONS.values() for src, dsts in edges.items() for st in (src, *dsts)})
    return render_template("jobs.html", items=items, state=state, kind=kind, q=q, kinds=sorted(states.TRANSITIONS),
                           all_states=every, sort=sort, page=number, more=more,
                           older=items[-1]["id"] if more and not sort.key else None)


@bp.route("/jobs/<int:job_id>")
def job(job_id: int) -> ResponseReturnValue:
    return render_template("job.html", j=data.job(settings(), job_id))


@bp.route("/jobs/<int:job_id>/stream")
def job_stream(job_id: int) -> ResponseReturnValue:
    """Server-sent events: the job's state and bytes, until it rests (``states.RESTING``).

    Each open stream holds one of the web server's few threads: a client gets at most
    ``CKPT_STREAMS_PER_CLIENT`` of them and all clients together ``CKPT_STREAMS``, so
    streams never take every thread; a page over the limit is told to reload (429)."""
    s = settings()
    data.job(s, job_id)  # 404 before the stream starts
    slot = streams.take(request.remote_addr or "-", current_app.config.get("CKPT_STREAMS", 4),
                        current_app.config.get("CKPT_STREAMS_PER_CLIENT", 2))
    if slot is None:
        return Response("too many open live updates; reload the page later\n", status=429,
                        headers={"Retry-After": "10"}, mimetype="text/plain")

    def events() -> Iterator[str]:
        try:
            last = None
            deadline = time.monotonic() + 3600
            sent = time.monotonic()
            while time.monotonic() < deadline:
                j = data.job(s, job_id)
                doc = {"id": j["id"], "state": j["state"], "bytes_done": j["bytes_done"],
                       "bytes_total": j["bytes_total"], "attempts": j["attempts"], "last_error": j["last_error"],
                       "terminal": j["resting"], "events": len(j["timeline"])}
                if doc != last:
                    yield f"data: {json.dumps(doc)}\n\n"
                    last, sent = doc, time.monotonic()
                elif time.monotonic() - sent >= HEARTBEAT_SECONDS:
                    # A comment the browser ignores. Writing is the only way to learn that the
                    # page has gone (it reloads on every event): the write fails, the stream
                    # ends and its slot is free for the reloaded page.
                    yield ": still here\n\n"
                    sent = time.monotonic()
                if j["resting"]:
                    return
                time.sleep(0.5)
        finally:
            slot.release()

    return Response(events(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


@bp.route("/workers")
def workers() -> ResponseReturnValue:
    q = request.args.get("q", "").strip() or None
    number = max(0, request.args.get("page", 0, type=int))
    sort = sorting.requested(sorting.WORKERS)
    found, stores = data.storage(settings(), search=q)
    items, more = data.paged(sort.rows(found, sorting.WORKERS), number)
    return render_template("workers.html", items=items, q=q, page=number, more=more, sort=sort,
                           sticky=sorted(states.STICKY_WORKERS), stores=stores)


@bp.route("/workers/<worker_id>/drain", methods=("POST",))
@form_admin
def worker_drain(worker_id: str) -> ResponseReturnValue:
    """Drain a worker: its shards are copied elsewhere, then it is marked removable."""
    try:
        operations.drain(settings(), worker_id)
        flash(f"storage worker {worker_id} is draining: its shards are copied to other workers; it shows as "
              "removable when that is done", "info")
    except CkptError as e:
        flash(str(e), "error")
    return redirect(url_for("pages.workers"), code=303)


@bp.route("/retention")
def retention() -> ResponseReturnValue:
    """GC and retention: each run's policy and pins, what the next collection would free."""
    return render_template("retention.html", g=data.retention(settings()))


@bp.route("/dead-letters")
def dead_letters() -> ResponseReturnValue:
    q = request.args.get("q", "").strip() or None
    number = max(0, request.args.get("page", 0, type=int))
    items, more = data.paged(data.dead_letters(settings(), search=q), number)
    return render_template("dead_letters.html", items=items, q=q, page=number, more=more)


@bp.route("/dead-letters/requeue", methods=("POST",))
@form_admin
def requeue() -> ResponseReturnValue:
    which = request.form.get("id") or None
    n = deadletters.requeue(settings(), None if which == "all" else [which] if which else [])
    flash(f"requeued {n} message(s)", "info" if n else "error")
    return redirect(url_for("pages.dead_letters"), code=303)


@bp.route("/actions")
@form_admin
def actions() -> ResponseReturnValue:
    return render_template("actions.html", roots=settings().roots, ckpts=data.checkpoints(settings()))


@bp.route("/actions/store", methods=("POST",))
@form_admin
def store() -> ResponseReturnValue:
    path = request.form.get("path", "").strip()
    if not path:
        flash("give the path of a checkpoint inside a watched root", "error")
        return redirect(url_for("pages.actions"), code=303)
    try:
        r = operations.store(settings(), path, detail="requested from the web UI")
    except CkptError as e:  # shown in the form that asked, with what was typed
        return render_template("actions.html", roots=settings().roots, ckpts=data.checkpoints(settings()),
                               store_error=str(e), form=request.form), status_of(e)
    return redirect(url_for("pages.job", job_id=r.job_id), code=303)


@bp.route("/actions/restore", methods=("POST",))
@form_admin
def restore() -> ResponseReturnValue:
    ref, dest = request.form.get("checkpoint", "").strip(), request.form.get("dest", "").strip()
    if not ref or not dest:
        flash("choose a checkpoint and a destination path", "error")
        return redirect(url_for("pages.actions"), code=303)
    try:
        r = operations.restore_to(settings(), ref, dest, overwrite=request.form.get("overwrite") == "on",
                                  host=chosen_host())
    except UnknownCheckpoint:
        raise
    except CkptError as e:  # shown in the form that asked, with what was typed
        return render_template("actions.html", roots=settings().roots, ckpts=data.checkpoints(settings()),
                               restore_error=str(e), form=request.form), status_of(e)
    return redirect(url_for("pages.job", job_id=r.job_id), code=303)


@bp.route("/actions/scrub", methods=("POST",))
@form_admin
def scrub() -> ResponseReturnValue:
    started = operations.scrub_now(settings(), reason="requested from the web UI")
    if not started:
        flash("no live storage worker to scrub", "error")
        return redirect(url_for("pages.actions"), code=303)
    if len(started) == 1:
        return redirect(url_for("pages.job", job_id=started[0].job_id), code=303)
    return redirect(url_for("pages.jobs", kind="scrub"), code=303)
