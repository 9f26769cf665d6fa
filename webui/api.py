"""The JSON API: the pages' data for scripts, and the same actions."""
from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, current_app, jsonify, request, url_for
from flask.typing import ResponseReturnValue

from pipeline import operations, states
from pipeline.settings import Settings
from pipeline.tasks import deadletters
from webui import bulk, data
from webui.errors import ApiError
from webui.security import api_admin

bp = Blueprint("api", __name__, url_prefix="/api")


def settings() -> Settings:
    return current_app.config["CKPT_SETTINGS"]


def json_body() -> Any:
    """The request's JSON, or None if it is not JSON; hostile nesting is a 400, not a crash."""
    try:
        return request.get_json(silent=True)
    except RecursionError:
        raise ApiError(400, "the body is JSON nested too deeply") from None


def body(*required: str) -> dict[str, Any]:
    doc = json_body()
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object")
    missing = [k for k in required if not isinstance(doc.get(k), (str, int)) or doc.get(k) == ""]
    if missing:
        raise ApiError(400, f"missing or empty field(s): {', '.join(missing)}")
    return doc


def flag(doc: dict[str, Any], name: str) -> bool:
    """A JSON boolean field (absent: false); ``"false"`` or ``0`` is a 400, never read as true."""
    value = doc.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f'"{name}" must be true or false (a JSON boolean), not {json.dumps(value)}')
    return value


def page_args() -> dict[str, Any]:
    """``before`` (an id: rows older than it) and ``limit`` (1..1000) of a paginated list."""
    limit = request.args.get("limit", data.PAGE, type=int)
    if not 1 <= limit <= 1000:
        raise ApiError(400, "limit must be between 1 and 1000")
    return {"before": request.args.get("before", type=int), "limit": limit}


def page(name: str, rows: list[dict[str, Any]], limit: int) -> ResponseReturnValue:
    nxt = rows[-1]["id"] if len(rows) == limit else None
    return jsonify({name: rows, "next_before": nxt})


@bp.get("/checkpoints")
def checkpoints() -> ResponseReturnValue:
    args = page_args()
    rows = data.checkpoints(settings(), state=request.args.get("state") or None,
                            run=request.args.get("run") or None, search=request.args.get("q") or None, **args)
    return page("checkpoints", rows, args["limit"])


@bp.get("/checkpoints/<int:checkpoint_id>")
def checkpoint(checkpoint_id: int) -> ResponseReturnValue:
    return jsonify(data.checkpoint(settings(), checkpoint_id))


@bp.get("/jobs")
def jobs() -> ResponseReturnValue:
    state, kind = request.args.get("state") or None, request.args.get("kind") or None
    if kind and kind not in states.TRANSITIONS:
        raise ApiError(400, f"unknown job kind {kind!r}; one of {', '.join(sorted(states.TRANSITIONS))}")
    args = page_args()
    return page("jobs", data.jobs(settings(), state=state, kind=kind, search=request.args.get("q") or None, **args),
                args["limit"])


@bp.get("/jobs/<int:job_id>")
def job(job_id: int) -> ResponseReturnValue:
    return jsonify(data.job(settings(), job_id))


@bp.get("/workers")
def workers() -> ResponseReturnValue:
    """Storage workers by id, a page (``?page=``, from 0) at a time; ``more`` when there is another;
    ``objectstores``: the object-store targets (a tier of their own, all of them, on every page)."""
    found, stores = data.storage(settings(), search=request.args.get("q") or None)
    rows, more = data.paged(found, request.args.get("page", 0, type=int))
    return jsonify(workers=rows, more=more, objectstores=stores)


@bp.get("/runs")
def run() -> ResponseReturnValue:
    """One run (``?name=``): its summary and a page (``?page=``, from 0) of its checkpoints by step."""
    name = request.args.get("name")
    if not name:
        raise ApiError(400, "name the run: /api/runs?name=<run>")
    return jsonify(data.run(settings(), name, state=request.args.get("state") or None,
                            search=request.args.get("q") or None, page=max(0, request.args.get("page", 0, type=int))))


@bp.get("/health")
def health() -> ResponseReturnValue:
    return jsonify(data.health(settings(), problems_only=request.args.get("problems") == "1",
                               before=request.args.get("before", type=int)))


@bp.get("/capacity")
def capacity() -> ResponseReturnValue:
    return jsonify(data.capacity_doc(settings()))


@bp.get("/retention")
def retention() -> ResponseReturnValue:
    """The GC and retention page's data: policies, pins, the next collection, the last ones."""
    return jsonify(data.retention(settings()))


@bp.get("/dead-letters")
def dead_letters() -> ResponseReturnValue:
    rows, more = data.paged(data.dead_letters(settings(), search=request.args.get("q") or None),
                            request.args.get("page", 0, type=int))
    return jsonify(dead_letters=rows, more=more)


def accepted(job_id: int, extra: dict[str, Any] | None = None) -> ResponseReturnValue:
    doc = data.job(settings(), job_id)
    if extra:
        doc.update(extra)
    resp = jsonify(doc)
    resp.status_code = 202
    resp.headers["Location"] = url_for("api.job", job_id=job_id)
    return resp


@bp.post("/store")
@api_admin
def store() -> ResponseReturnValue:
    r = operations.store(settings(), str(body("path")["path"]), detail="requested over HTTP")
    return accepted(r.job_id, {"created": r.created, "checkpoint_id": r.checkpoint_id})


@bp.post("/restore")
@api_admin
def restore() -> ResponseReturnValue:
    doc = body("checkpoint", "dest")
    host = doc.get("host")
    if host is not None and (not isinstance(host, str) or not host):
        raise ApiError(400, '"host" must be the id of a training host (GET /api/hosts lists them)')
    r = operations.restore_to(settings(), doc["checkpoint"], str(doc["dest"]), overwrite=flag(doc, "overwrite"),
                              host=host)
    return accepted(r.job_id, {"host": host or settings().host_id})


@bp.get("/hosts")
def hosts() -> ResponseReturnValue:
    """The training hosts; ``consumer_live``: a restore may be sent there now."""
    return jsonify(hosts=data.hosts(settings()), this_host=settings().host_id)


@bp.post("/scrub")
@api_admin
def scrub() -> ResponseReturnValue:
    doc = json_body() if request.get_data() else {}  # no body: every live worker
    if not isinstance(doc, dict):
        raise ApiError(400, 'the body must be empty or a JSON object {"workers": [...]}')
    workers = doc.get("workers")
    if workers is not None and not (isinstance(workers, list) and all(isinstance(w, str) for w in workers)):
        raise ApiError(400, '"workers" must be a list of storage worker ids')
    started = operations.scrub_now(settings(), workers or None, reason="requested over HTTP")
    if not started:
        raise ApiError(409, "no live storage worker to scrub")
    resp = jsonify(jobs=[data.job(settings(), r.job_id) for r in started])
    resp.status_code = 202
    resp.headers["Location"] = url_for("api.job", job_id=started[0].job_id)
    return resp


@bp.post("/gc")
@api_admin
def gc() -> ResponseReturnValue:
    """``{"dry_run": true}``: what a collection would free per worker; otherwise start one."""
    doc = json_body() if request.get_data() else {}
    if not isinstance(doc, dict):
        raise ApiError(400, 'the body must be empty or a JSON object {"dry_run": bool, "workers": [...]}')
    workers = doc.get("workers")
    if workers is not None and not (isinstance(workers, list) and all(isinstance(w, str) for w in workers)):
        raise ApiError(400, '"workers" must be a list of storage worker ids')
    r = operations.collect_garbage(settings(), workers or None, dry_run=flag(doc, "dry_run"),
                                   reason="requested over HTTP")
    resp = jsonify(jobs=[data.job(settings(), j.job_id) for j in r.jobs], condemned=r.condemned,
                   condemned_bytes=r.condemned_bytes, freed=[f.__dict__ for f in r.freed])
    resp.status_code = 200 if flag(doc, "dry_run") else 202
    return resp


@bp.post("/checkpoints/bulk")
@api_admin
def checkpoints_bulk() -> ResponseReturnValue:
    """``{"action": "pin"|"unpin"|"forget", "checkpoints": [ids], "note": ..., "dry_run": bool}``:
    each checkpoint done (or, with ``dry_run``, what would happen) or refused on its own,
    with the reason; 200 whatever the outcomes (webui.bulk)."""
    doc = body("action")
    action, ids, note = doc["action"], doc.get("checkpoints"), doc.get("note")
    if action not in bulk.ACTIONS:
        raise ApiError(400, f'"action" must be one of {", ".join(bulk.ACTIONS)}, not {json.dumps(action)}')
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ApiError(400, '"checkpoints" must be a non-empty list of checkpoint ids')
    if note is not None and not isinstance(note, str):
        raise ApiError(400, '"note" must be text')
    dry_run = flag(doc, "dry_run")
    outcomes = bulk.run(settings(), action, ids, note=note, dry_run=dry_run)
    return jsonify(action=action, dry_run=dry_run, results=bulk.as_json(outcomes),
                   done=sum(o.ok for o in outcomes), refused=sum(not o.ok for o in outcomes),
                   last_copy=bulk.last_copy(settings()) if action == "forget" else None)


@bp.post("/checkpoints/<int:checkpoint_id>/<any(pin, unpin, forget):action>")
@api_admin
def checkpoint_action(checkpoint_id: int, action: str) -> ResponseReturnValue:
    """Pin (``{"note": ...}``), unpin or forget (``{"dry_run": true}`` to see) one checkpoint."""
    doc = json_body() if request.get_data() else {}
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be empty or a JSON object")
    if action == "forget":
        verdicts = operations.forget(settings(), [str(checkpoint_id)], dry_run=flag(doc, "dry_run"))
        return jsonify(forgotten=[v.__dict__ for v in verdicts], dry_run=flag(doc, "dry_run"))
    note = doc.get("note")
    if note is not None and not isinstance(note, str):
        raise ApiError(400, '"note" must be text')
    operations.pin(settings(), str(checkpoint_id), note, pinned=action == "pin")
    return jsonify(data.checkpoint(settings(), checkpoint_id))


@bp.post("/dead-letters/<letter_id>/requeue")
@api_admin
def requeue(letter_id: str) -> ResponseReturnValue:
    if letter_id == "all":
        return jsonify(requeued=deadletters.requeue(settings(), None))
    if not any(d["id"] == letter_id or d["message_id"] == letter_id for d in deadletters.list_letters(settings())):
        raise ApiError(404, f"no dead letter {letter_id!r}")
    return jsonify(requeued=deadletters.requeue(settings(), [letter_id]))
