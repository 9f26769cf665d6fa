"""Alerts: the conditions that call for a person, evaluated from the control plane.

Each condition (:data:`KINDS`) is found by a query of the database (and, for dead letters, of
the broker; for degraded runs, of the home's ledger, pipeline/degraded.py). The scheduler's
leader evaluates them every sweep (:func:`refresh`) and keeps one ``alerts`` row per occurrence:
since when it holds, when it fired (once it held longer than its threshold), when it was
resolved (once not found for ``alert_clear_seconds``: a condition that flaps is one alert), by
which job, and what really became of its subject. The web UI's banner shows the open ones that fired
(:func:`active`), the incidents page their history (:func:`incidents`), ``/metrics`` counts
them (``ckpt_alert_active``), and the optional webhook (pipeline/webhook.py) is told of each
firing and each resolution. docs/design.md, section 5, "Alerts".
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline import capacity, degraded, states
from pipeline.cron import last_fire
from pipeline.db.content_rf import run_rf
from pipeline.db.copies import short_contents
from pipeline.db.engine import session_scope
from pipeline.db.models import Alert, Checkpoint, CheckpointFile, Job, JobEvent, Lock, Shard, StorageWorker
from pipeline.db.transitions import now
from pipeline.settings import Settings
from pipeline.states import JobKind, WorkerState
from pipeline.status import lost_checkpoints, lost_contents, run_facts

log = logging.getLogger("ckpt.alerts")

CRITICAL, WARNING = "critical", "warning"


@dataclass(frozen=True)
class Kind:
    """One alert condition: its severity, what it is called, and the setting naming how long it
    must hold before it fires (None: at once)."""

    severity: str
    title: str
    threshold: str | None = None

    def seconds(self, settings: Settings) -> float:
        return float(getattr(settings, self.threshold)) if self.threshold else 0.0


KINDS: dict[str, Kind] = {
    "worker_down": Kind(WARNING, "storage worker down", "alert_worker_down_seconds"),
    "content_lost": Kind(CRITICAL, "content lost"),
    "under_replicated": Kind(CRITICAL, "content under-replicated", "alert_under_replicated_seconds"),
    "run_unprotected": Kind(CRITICAL, "run unprotected", "alert_unprotected_seconds"),
    "disk_full": Kind(WARNING, "disk above its watermark", "alert_disk_full_seconds"),
    "dead_letters": Kind(WARNING, "dead letters"),
    "scrub_overdue": Kind(WARNING, "scrub overdue"),
}
#: Banner order: the most severe first.
SEVERITY_ORDER = (CRITICAL, WARNING)
#: The row of the locks table that holds when alerts were last evaluated.
EVALUATED = "alerts:evaluated"
#: The most items an alert's evidence keeps (its resolution speaks of those).
EVIDENCE = 1000


@dataclass(frozen=True)
class Condition:
    """A condition found now. ``since``: since when it holds by its own evidence (a worker's
    last answer, a run's first unprotected save); None: since the first evaluation that found it.
    ``evidence``: what it is about, for its resolution (:attr:`Alert.evidence`)."""

    alert: str
    subject: str
    summary: str
    link: str
    since: datetime | None = None
    evidence: tuple[Any, ...] | None = None

    @property
    def key(self) -> str:
        return key_of(self.alert, self.subject)


def key_of(alert: str, subject: str) -> str:
    return f"{alert}:{hashlib.sha256(subject.encode()).hexdigest()[:40]}"


def _run_link(run: str) -> str:
    return "/runs?" + urlencode({"name": run})


def _workers_down(s: Session, settings: Settings, at: datetime) -> list[Condition]:
    out = []
    for w in s.scalars(select(StorageWorker).where(StorageWorker.state.in_((WorkerState.DOWN, WorkerState.REJECTED)))
                       .order_by(StorageWorker.id)):
        why = f": {w.last_error}" if w.last_error else ""
        out.append(Condition("worker_down", w.id, f"storage worker {w.id} is {w.state}{why}",
                             "/workers?" + urlencode({"q": w.id}), w.last_seen))
    return out


def _content_lost(s: Session, settings: Settings, at: datetime) -> list[Condition]:
    n = lost_checkpoints(s)
    if not n:
        return []
    shas = lost_contents()
    contents = s.scalar(select(func.count()).select_from(
        shas.where(shas.selected_columns[0].in_(select(Shard.sha256))).subquery())) or 0
    first = s.scalar(select(func.min(Job.finished_at)).where(Job.kind == JobKind.REPAIR, Job.state == "lost",
                                                            Job.sha256.in_(shas)))
    ids = s.scalars(select(Checkpoint.id).join(CheckpointFile).join(Shard).where(
        Checkpoint.current.is_(True), Checkpoint.local_present.is_(False),
        Checkpoint.store_state.in_(sorted(states.PROTECTED)), Shard.sha256.in_(shas))
        .distinct().order_by(Checkpoint.id).limit(EVIDENCE))
    return [Condition("content_lost", "", f"{n} checkpoint(s) LOST: {contents} content(s) with no copy that "
                      "matches the manifest and no local copy to rebuild from", "/health?problems=1", first,
                      tuple(ids))]


def _under_replicated(s: Session, settings: Settings, at: datetime) -> list[Condition]:
    short = short_contents(s, run_rf(s, settings))
    if not short:
        return []
    return [Condition("under_replicated", "", f"{len(short)} content(s) of protected checkpoints have fewer than "
                      f"{settings.rf_said()} good copies", "/health?problems=1",
                      evidence=tuple(sorted(short)[:EVIDENCE]))]


def _runs_unprotected(s: Session, settings: Settings, at: datetime) -> list[Condition]:
    found: dict[str, tuple[datetime, str]] = {}
    for run, f in run_facts(s).items():
        newest = f["newest"]
        whole = newest is not None and newest.id in f["protected_save"]  # the save latest() answers
        if newest is None or whole or newest.store_state in states.RELEASED:
            continue
        # Since the first save after the newest protected one that is still not protected: a
        # run whose every save is late is unprotected since it fell behind, not since its last save.
        after = [Checkpoint.id > f["protected"].id] if f["protected"] is not None else []
        since = s.scalar(select(func.min(Checkpoint.detected_at)).where(
            Checkpoint.run == run, Checkpoint.current.is_(True), *after,
            Checkpoint.store_state.not_in(sorted(states.PROTECTED | states.RELEASED)))) or newest.detected_at
        found[run] = (since, f"run {run}: its newest save {newest.name} is {newest.store_state}, not protected"
                      if newest.store_state not in states.PROTECTED else
                      f"run {run}: its newest save, of which {newest.name} is a file, is not protected whole")
    for d in degraded.listed(settings.home):
        text = f"run {d.run}: protection degraded, {d.failures} save(s) its trainer could not protect: {d.cause}"
        if d.run in found:
            since, words = found[d.run]
            found[d.run] = (min(since, d.since), f"{words}; {text}")
        else:
            found[d.run] = (d.since, text)
    return [Condition("run_unprotected", run, words, _run_link(run), since)
            for run, (since, words) in sorted(found.items())]


def _disks_full(s: Session, settings: Settings, at: datetime) -> list[Condition]:
    """One condition per filesystem above the high watermark, however many workers share it (as
    pipeline/capacity.py counts it: ``ckpt up``'s three local workers are one disk). Hysteresis:
    an alert of a disk that fired holds until the disk is ``alert_disk_clear_margin`` below the
    mark, so a disk hovering at the mark is one alert, not one per sweep (one not fired yet fires
    only if the disk stays above the mark, with dips shorter than ``alert_clear_seconds``)."""
    holding = set(s.scalars(select(Alert.subject).where(Alert.alert == "disk_full", Alert.resolved_at.is_(None),
                                                        Alert.fired_at.is_not(None), Alert.cleared_at.is_(None))))
    high = settings.high_watermark
    low = high - settings.alert_disk_clear_margin
    out = []
    for fs in capacity.readable_disks(s):
        used = fs.used_ratio
        if not (used > high or (fs.id in holding and used > low)):
            continue
        disk = (f"storage worker {fs.workers[0]}'s disk" if len(fs.workers) == 1 else
                f"the disk of storage workers {', '.join(fs.workers)}")
        if not fs.id.startswith("worker:"):
            disk += f" (filesystem {fs.id})"
        gets = "it gets" if len(fs.workers) == 1 else "they get"
        state = (f"above the {high:.0%} watermark: {gets} no new copies" if used > high else
                 f"back under the {high:.0%} watermark, not yet below {low:.0%}")
        out.append(Condition("disk_full", fs.id, f"{disk} is {used:.0%} full, {state}",
                             "/workers?" + urlencode({"q": fs.workers[0]}) if len(fs.workers) == 1 else "/workers",
                             evidence=fs.workers))
    return out


def _scrubs_overdue(s: Session, settings: Settings, at: datetime) -> list[Condition]:
    if not settings.scrub_cron:
        return []
    due = last_fire(settings.scrub_cron, at - timedelta(seconds=settings.alert_scrub_grace_seconds))
    first = s.scalar(select(func.min(Checkpoint.detected_at)))
    if due is None or first is None or first > due:  # nothing was protected when it was due
        return []
    last = last_scrubs(s)
    out = []
    for w in s.scalars(select(StorageWorker.id).where(StorageWorker.state.in_(sorted(states.READABLE_WORKERS)))
                       .order_by(StorageWorker.id)):
        done = last.get(w)
        if done is not None and done >= due:
            continue
        before = f"its last scrub finished {done:%Y-%m-%d %H:%M} UTC" if done else "it was never scrubbed"
        out.append(Condition("scrub_overdue", w, f"scrub of storage worker {w} overdue: due {due:%Y-%m-%d %H:%M %Z},"
                             f" {before}", "/jobs?kind=scrub", due))
    return out


def last_scrubs(s: Session) -> dict[str, datetime]:
    """Per storage worker, when its last scrub finished (of the recent ones: a worker's scrub
    is at most a day old when all is well)."""
    last: dict[str, datetime] = {}
    for params, finished in s.execute(select(Job.params, Job.finished_at).where(
            Job.kind == JobKind.SCRUB, Job.state == "done", Job.finished_at.is_not(None))
            .order_by(Job.finished_at.desc()).limit(5000)):
        last.setdefault(str((params or {}).get("worker_id")), finished)
    return last


#: The database's conditions, each found by one function.
CHECKS: dict[str, Callable[[Session, Settings, datetime], list[Condition]]] = {
    "worker_down": _workers_down, "content_lost": _content_lost, "under_replicated": _under_replicated,
    "run_unprotected": _runs_unprotected, "disk_full": _disks_full, "scrub_overdue": _scrubs_overdue,
}


def dead_letter_condition(count: int, oldest: datetime | None) -> list[Condition]:
    if not count:
        return []
    return [Condition("dead_letters", "", f"{count} dead letter(s): messages given up on after their retries",
                      "/dead-letters", oldest)]


def evaluate(s: Session, settings: Settings, at: datetime,
             dead_letters: tuple[int, datetime | None] | None = None) -> tuple[list[Condition], set[str]]:
    """Every condition that holds now, and the kinds that could not be evaluated (their open
    alerts are left as they are). ``dead_letters``: (count, oldest failure), None when the
    broker could not be read."""
    found: list[Condition] = []
    unknown: set[str] = set()
    for kind, check in CHECKS.items():
        try:
            with s.begin_nested():
                found += check(s, settings, at)
        except Exception:
            log.exception("alerts: could not evaluate %s", kind)
            unknown.add(kind)
    if dead_letters is None:
        unknown.add("dead_letters")
    else:
        found += dead_letter_condition(*dead_letters)
    return found, unknown


def _resolver(s: Session, settings: Settings, row: Alert) -> tuple[int | None, str]:
    """The job that repaired an alert's condition, if one did, and the resolution in words: what
    really became of its subject (a worker that answered again, or was removed; lost checkpoints
    repaired, or forgotten; a run protected, or its unprotected saves deleted)."""
    def newest(kind: str, *workers: str) -> Job | None:
        q = (select(Job).where(Job.kind == kind, Job.state == "done", Job.finished_at >= row.since)
             .order_by(Job.finished_at.desc()).limit(200))
        return next((j for j in s.scalars(q) if not workers or (j.params or {}).get("worker_id") in workers), None)

    job: Job | None = None
    if row.alert == "worker_down":
        job, words = _worker_back(s, row.subject, newest)
    elif row.alert == "content_lost":
        job, words = _lost_resolved(s, row.evidence, newest)
    elif row.alert == "under_replicated":
        job, words = _short_resolved(s, row.evidence, newest)
    elif row.alert == "scrub_overdue":
        job, words = _scrub_resolved(s, settings, row.subject, newest)
    elif row.alert == "run_unprotected":
        job, words = _run_resolved(s, row.subject)
    elif row.alert == "disk_full":
        job, words = _disk_resolved(s, settings, row, newest)
    else:
        words = "no dead letter left (requeued, dropped or expired)"
    if job is not None:
        words += f" (by {job.kind} job {job.id})"
    return (job.id if job is not None else None), words


Newest = Callable[..., Job | None]


def _gone(s: Session, worker_ids: list[str]) -> tuple[list[str], dict[str, str]]:
    """Of ``worker_ids``: those no longer recorded (removed), and the state of the others."""
    rows = dict(s.execute(select(StorageWorker.id, StorageWorker.state).where(StorageWorker.id.in_(worker_ids))).all())
    return [w for w in worker_ids if w not in rows], rows


def _worker_back(s: Session, worker: str, newest: Newest) -> tuple[Job | None, str]:
    removed, state = _gone(s, [worker])
    if removed:
        return None, f"{worker} was removed (`ckpt workers remove`); it did not answer again"
    if state[worker] in states.STICKY_WORKERS:
        return None, f"{worker} is {state[worker]} (an operator's drain); it did not answer again"
    if state[worker] not in states.COUNTING_WORKERS:
        return None, f"{worker} is {state[worker]}"
    return newest(JobKind.RECONCILE, worker), f"{worker} answered again"


def _scrub_resolved(s: Session, settings: Settings, worker: str, newest: Newest) -> tuple[Job | None, str]:
    job = newest(JobKind.SCRUB, worker)
    if job is not None:
        return job, f"{worker} was scrubbed"
    removed, state = _gone(s, [worker])
    if removed:
        return None, f"{worker} was removed (`ckpt workers remove`), not scrubbed"
    if state[worker] not in states.SCRUBBED_WORKERS:
        return None, f"{worker} is {state[worker]}: not scrubbed until it is back"
    if not settings.scrub_cron:
        return None, "the scrub schedule was turned off (CKPT_SCRUB_CRON empty), not scrubbed"
    return None, f"{worker}'s scrub is no longer overdue"


def _disk_resolved(s: Session, settings: Settings, row: Alert, newest: Newest) -> tuple[Job | None, str]:
    members = [str(w) for w in (row.evidence or [])] or [row.subject.removeprefix("worker:")]
    removed, state = _gone(s, members)
    readable = [w for w in members if state.get(w) in states.READABLE_WORKERS]
    if not readable:
        said = [f"{w} was removed" for w in removed] + [f"{w} is {state[w]}" for w in members if w in state]
        return None, f"no readable worker on that disk any more: {', '.join(said)}"
    low = settings.high_watermark - settings.alert_disk_clear_margin
    return newest(JobKind.GC, *readable), f"the disk of {', '.join(readable)} is below {low:.0%} again"


def _lost_resolved(s: Session, evidence: list[Any] | None, newest: Newest) -> tuple[Job | None, str]:
    if evidence is None:  # recorded before revision 0015: what the copies say now
        still = s.scalar(lost_contents().limit(1)) is not None
        return (None, "no kept checkpoint needs the lost content(s) any more") if still else (
            newest(JobKind.REPAIR), "every content has its copies again")
    rows = s.execute(select(Checkpoint.id, Checkpoint.name, Checkpoint.store_state, Checkpoint.current,
                            Checkpoint.local_present).where(Checkpoint.id.in_(evidence))).all()
    why: dict[str, int] = {}
    for _id, _name, state, current, local in rows:
        if state in states.RELEASED:
            reason = f"{state} (no longer kept)"
        elif state not in states.PROTECTED:
            reason = f"{state}"
        elif not current:
            reason = "replaced by a newer version"
        elif local:
            reason = "whose file is on its host again"
        else:
            reason = "repaired: every content has a good copy again"
        why[reason] = why.get(reason, 0) + 1
    if len(rows) < len(evidence):
        why["deleted from the catalog"] = len(evidence) - len(rows)
    repaired = "repaired: every content has a good copy again"
    job = newest(JobKind.REPAIR) if repaired in why else None
    if set(why) == {repaired}:
        return job, "every content has its copies again"
    return job, "the lost checkpoint(s): " + "; ".join(f"{n} {reason}" for reason, n in sorted(why.items()))


def _short_resolved(s: Session, evidence: list[Any] | None, newest: Newest) -> tuple[Job | None, str]:
    if not evidence:  # recorded before revision 0015
        return newest(JobKind.REPAIR), "every content has its copies again"
    needed = set(s.scalars(select(Shard.sha256).join(CheckpointFile).join(Checkpoint).where(
        Checkpoint.store_state.in_(sorted(states.PROTECTED)), Shard.sha256.in_(evidence)).distinct()))
    if len(needed) == len(set(evidence)):
        return newest(JobKind.REPAIR), "every content has its copies again"
    gone = len(set(evidence) - needed)
    words = f"{gone} content(s) no protected checkpoint needs any more (forgotten, superseded or deleted)"
    if needed:
        return newest(JobKind.REPAIR), f"{len(needed)} content(s) have their copies again; {words}"
    return None, words


def _run_resolved(s: Session, run: str) -> tuple[Job | None, str]:
    last = s.scalar(select(Checkpoint).where(Checkpoint.run == run, Checkpoint.current.is_(True))
                    .order_by(Checkpoint.id.desc()).limit(1))
    if last is None:
        return None, "the run has no checkpoint left (deleted from the catalog)"
    if last.store_state in states.PROTECTED:
        job = s.scalar(select(Job).where(Job.kind == JobKind.STORE, Job.checkpoint_id == last.id)
                       .order_by(Job.id.desc()).limit(1))
        return job, f"{last.name} is protected"
    if last.store_state in states.RELEASED:
        how = "deleted from disk" if last.store_state == states.StoreState.VANISHED else last.store_state
        return None, f"its unprotected saves are gone: its newest, {last.name}, is {how}, not protected"
    return None, "its trainer's saves are protected again"


def event_of(row: Alert, event: str) -> dict[str, Any]:
    """What the webhook is told of an alert (and what the API lists)."""
    return {"event": event, "id": row.id, "alert": row.alert, "title": KINDS[row.alert].title,
            "severity": row.severity, "subject": row.subject, "summary": row.summary, "link": row.link,
            "since": row.since, "fired_at": row.fired_at, "resolved_at": row.resolved_at,
            "resolved_by": row.resolved_by, "resolution": row.resolution}


def refresh(settings: Settings, at: datetime | None = None,
            dead_letters: tuple[int, datetime | None] | None = None) -> list[dict[str, Any]]:
    """Evaluate every condition and bring the ``alerts`` rows up to date: a new condition opens
    a row, one that held longer than its threshold fires, one that has not been found for
    ``alert_clear_seconds`` is resolved (with the job that repaired it and what became of its
    subject), or dropped if it never fired. Found again within that time, it is the same
    occurrence (since its first evaluation): a condition that flaps (a worker answering every
    other probe) is one alert that fires once, not one per flap. Returns the events (``fired``,
    ``resolved``) in the order they happened, for the webhook."""
    t = at or now()
    events: list[tuple[Alert, str]] = []
    # The conditions' queries (some scan every protected checkpoint's copies) run in a read-only
    # session: on SQLite a write transaction would hold every writer back for as long.
    with session_scope(settings.db_url, readonly=True) as s:
        found, unknown = evaluate(s, settings, t, dead_letters)
    with session_scope(settings.db_url) as s:
        rows = {r.key: r for r in s.scalars(select(Alert).where(Alert.resolved_at.is_(None)))}
        for c in found:
            kind = KINDS[c.alert]
            row = rows.pop(c.key, None)
            if row is None:
                row = Alert(key=c.key, alert=c.alert, subject=c.subject, since=c.since or t)
                s.add(row)
            elif c.since is not None:
                row.since = min(row.since, c.since)  # through a short clear: still the first occurrence
            row.severity, row.summary, row.link, row.last_seen = kind.severity, c.summary, c.link, t
            row.cleared_at, row.evidence = None, (list(c.evidence) if c.evidence is not None else row.evidence)
            if row.fired_at is None and (t - row.since).total_seconds() >= kind.seconds(settings):
                row.fired_at = t
                events.append((row, "fired"))
        for row in rows.values():
            if row.alert in unknown:
                continue
            row.cleared_at = row.cleared_at or t
            if (t - row.cleared_at).total_seconds() < settings.alert_clear_seconds:
                continue  # not found for a moment: kept open, in case it is found again
            if row.fired_at is None:  # cleared before its threshold: nobody was told, nothing to keep
                s.delete(row)
                continue
            row.resolved_at = t
            row.resolved_by, row.resolution = _resolver(s, settings, row)
            events.append((row, "resolved"))
        mark = s.get(Lock, EVALUATED)
        if mark is None:
            s.add(Lock(name=EVALUATED, holder="scheduler", expires_at=t))
        else:
            mark.expires_at = t
        s.flush()
        out = [event_of(row, what) for row, what in events]
    for e in out:
        log.warning("alert %s: %s (%s) %s", e["event"], e["title"], e["severity"], e["summary"])
    return out


def active(settings: Settings) -> dict[str, Any]:
    """What the banner shows: the open alerts that fired (most severe first, then oldest), and
    when the conditions were last evaluated (None: never)."""
    with session_scope(settings.db_url, readonly=True) as s:
        rows = s.scalars(select(Alert).where(Alert.resolved_at.is_(None), Alert.fired_at.is_not(None))
                         .order_by(Alert.since)).all()
        mark = s.get(Lock, EVALUATED)
        items = sorted((event_of(r, "active") for r in rows), key=lambda e: SEVERITY_ORDER.index(e["severity"]))
        return {"alerts": items, "evaluated_at": mark.expires_at if mark is not None else None}


def counts(settings: Settings) -> dict[str, int]:
    """Open alerts that fired, per kind (every kind, 0 when none)."""
    with session_scope(settings.db_url, readonly=True) as s:
        rows = dict(s.execute(select(Alert.alert, func.count(Alert.id))
                              .where(Alert.resolved_at.is_(None), Alert.fired_at.is_not(None))
                              .group_by(Alert.alert)).all())
    return {k: int(rows.get(k, 0)) for k in KINDS}


def incidents(settings: Settings, limit: int = 200) -> list[dict[str, Any]]:
    """The history, newest first: every alert that fired (found, resolved, by which job), and
    every repair (what found the damage, what became of it: a corrupt copy a scrub found and a
    repair rebuilt leaves only these jobs)."""
    out: list[dict[str, Any]] = []
    with session_scope(settings.db_url, readonly=True) as s:
        for r in s.scalars(select(Alert).where(Alert.fired_at.is_not(None)).order_by(Alert.since.desc()).limit(limit)):
            out.append({"source": "alert", "id": r.id, "kind": KINDS[r.alert].title, "severity": r.severity,
                        "what": r.summary, "link": r.link, "found_at": r.since, "found_by": None,
                        "fired_at": r.fired_at, "resolved_at": r.resolved_at, "resolved_by": r.resolved_by,
                        "resolution": r.resolution})
        repairs = s.scalars(select(Job).where(Job.kind == JobKind.REPAIR).order_by(Job.id.desc()).limit(limit)).all()
        last = dict(s.execute(select(JobEvent.job_id, JobEvent.detail).where(
            JobEvent.id.in_(select(func.max(JobEvent.id)).where(
                JobEvent.job_id.in_([j.id for j in repairs])).group_by(JobEvent.job_id)))).all())
        for j in repairs:
            params = j.params or {}
            sha = str(params.get("sha256") or j.sha256 or "")
            resolved = j.state == "done"
            if resolved:
                resolution = f"repaired: {last.get(j.id) or 'done'}"
            elif j.state == "lost":
                resolution = f"LOST: {j.last_error or last.get(j.id) or 'no copy matches'}"
            elif j.state == "failed":
                resolution = f"repair failed: {j.last_error or ''}".rstrip(": ")
            else:
                resolution = None  # still repairing
            out.append({"source": "repair", "id": j.id, "kind": "damaged copy", "severity":
                        CRITICAL if j.state == "lost" else WARNING,
                        "what": f"content {sha[:12]}: {params.get('reason') or 'needed repair'}",
                        "link": f"/jobs/{j.id}", "found_at": j.created_at,
                        "found_by": params.get("found_by"), "fired_at": j.created_at,
                        "resolved_at": j.finished_at if resolved else None,
                        "resolved_by": j.id if resolved else None, "resolution": resolution, "state": j.state})
    out.sort(key=lambda i: i["found_at"], reverse=True)
    return out[:limit]
