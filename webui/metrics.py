"""``/metrics`` in the Prometheus text format, computed from the control plane at scrape time."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis
from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from pipeline import alerts, capacity, consumers, queues, states
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint, Job, JobEvent, QueueConsumer, RunStateCount
from pipeline.objectstore import report as objectstore_report
from pipeline.states import JobKind, WorkerState
from pipeline.status import degraded_runs, problem_dicts, run_summaries
from pipeline.tasks import deadletters
from webui import data

log = logging.getLogger("ckpt.web")
bp = Blueprint("metrics", __name__)
BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


def _histogram(name: str, doc: str, values: list[float]) -> HistogramMetricFamily:
    counts, acc = [], 0
    for b in BUCKETS:
        acc = sum(1 for v in values if v <= b)
        counts.append((str(b), acc))
    counts.append(("+Inf", len(values)))
    return HistogramMetricFamily(name, doc, buckets=counts, sum_value=sum(values))


class ControlPlaneCollector:
    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def collect(self) -> Iterator[Any]:
        s = self.settings
        jobs = GaugeMetricFamily("ckpt_jobs", "Jobs by kind and state", labels=["kind", "state"])
        with session_scope(s.db_url, readonly=True) as session:
            for kind, state, n in session.execute(select(Job.kind, Job.state, func.count(Job.id))
                                                  .group_by(Job.kind, Job.state)):
                jobs.add_metric([kind, state], n)
            # The protected checkpoints' bytes, as kept with the per-run counts (run_state_counts).
            stored = session.scalar(select(func.coalesce(func.sum(RunStateCount.bytes), 0))
                                    .where(RunStateCount.store_state.in_(sorted(states.PROTECTED)))) or 0
            restored = session.scalar(select(func.coalesce(func.sum(Checkpoint.total_bytes), 0))
                                      .join(Job, Job.checkpoint_id == Checkpoint.id)
                                      .where(Job.kind == JobKind.RESTORE, Job.state == "done")) or 0
            steps = _step_durations(session)
            # What the run and capacity gauges need, not the whole of `ckpt status`.
            doc = {"runs": run_summaries(session, s), "problems": problem_dicts(session),
                   "capacity": capacity.usage(session, s).as_dict(), "run_usage": capacity.per_run(session),
                   "degraded": degraded_runs(s), "last_scrubs": alerts.last_scrubs(session)}
            on_disks = capacity.readable_disks(session)
            stores, lagging = objectstore_report.targets(session), objectstore_report.lagging_contents(session)
        yield jobs
        yield from _objectstore_metrics(stores, lagging)
        g = GaugeMetricFamily("ckpt_bytes_stored", "Bytes of checkpoints stored and verified")
        g.add_metric([], stored)
        yield g
        g = GaugeMetricFamily("ckpt_bytes_restored", "Bytes of checkpoints restored")
        g.add_metric([], restored)
        yield g
        yield _histogram("ckpt_transfer_seconds", "Seconds from sharded to replicated (store transfers)",
                         steps["transfer"])
        yield _histogram("ckpt_verify_seconds", "Seconds from replicated to verified", steps["verify"])
        yield _histogram("ckpt_restore_seconds", "Seconds from queued to done (restores)", steps["restore"])
        h = data.health(s)
        reps = GaugeMetricFamily("ckpt_replicas", "Replicas by health", labels=["health"])
        for name, n in sorted(h["replicas"].items()):
            reps.add_metric([name], n)
        yield reps
        shards = GaugeMetricFamily("ckpt_shards", "Shards by health (lost: no copy matches)", labels=["health"])
        for name in ("healthy", "under-replicated", "lost"):
            shards.add_metric([name], h["shards"].get(name, 0))
        yield shards
        up = GaugeMetricFamily("ckpt_worker_up", "1 if the storage worker is up", labels=["worker", "state"])
        free = GaugeMetricFamily("ckpt_worker_free_bytes", "Free bytes on the storage worker", labels=["worker"])
        used = GaugeMetricFamily("ckpt_worker_disk_used_ratio", "Used fraction of the storage worker's capacity "
                                 "(1 - free / capacity)", labels=["worker"])
        for w in data.workers(s):
            up.add_metric([w["id"], w["state"]], 1 if w["state"] == WorkerState.UP else 0)
            free.add_metric([w["id"]], w["free_bytes"])
            if w["capacity_bytes"]:
                used.add_metric([w["id"]], 1 - w["free_bytes"] / w["capacity_bytes"])
        disks = GaugeMetricFamily("ckpt_filesystem_used_ratio", "Used fraction of a filesystem the readable storage "
                                  "workers are on, counted once however many share it",
                                  labels=["filesystem", "workers"])
        for fs in on_disks:
            disks.add_metric([fs.id, ",".join(fs.workers)], fs.used_ratio)
        mark = GaugeMetricFamily("ckpt_high_watermark_ratio", "Used fraction above which a storage worker is full "
                                 "(CKPT_HIGH_WATERMARK)")
        mark.add_metric([], s.high_watermark)
        yield up
        yield free
        yield used
        yield disks
        yield mark
        yield from _alert_metrics(s, doc)
        yield from _detection_metrics(doc)
        yield from _capacity_metrics(doc)
        yield from _queue_metrics(s)


def _objectstore_metrics(stores: list[dict[str, Any]], lagging: int) -> Iterator[Any]:
    """The object-store tier on its own: per target up, used bytes, quota, copies; the contents
    placed on an object store and not confirmed there yet."""
    up = GaugeMetricFamily("ckpt_objectstore_up", "1 if the object-store target answers (up or full)",
                           labels=["target", "state"])
    used = GaugeMetricFamily("ckpt_objectstore_used_bytes", "Bytes of the copies recorded on the target",
                             labels=["target"])
    quota = GaugeMetricFamily("ckpt_objectstore_quota_bytes", "The target's quota_bytes (0: none)", labels=["target"])
    held = GaugeMetricFamily("ckpt_objectstore_copies", "Copies the target holds (stored or verified)",
                             labels=["target"])
    for o in stores:
        up.add_metric([o["id"], o["state"]], 1 if o["state"] in states.COUNTING_WORKERS else 0)
        used.add_metric([o["id"]], o["used_bytes"])
        quota.add_metric([o["id"]], o["quota_bytes"])
        held.add_metric([o["id"]], o["copies"])
    lag = GaugeMetricFamily("ckpt_objectstore_lagging_contents", "Contents placed on an object store and not "
                            "confirmed there yet (a lagging or waiting copy)")
    lag.add_metric([], lagging)
    yield from (up, used, quota, held, lag)


def _alert_metrics(settings: Any, doc: dict[str, Any]) -> Iterator[Any]:
    """The alerts the scheduler keeps (pipeline/alerts.py), and what the rules of
    docs/alerts.yml need besides the gauges above: dead letters, each worker's last scrub."""
    active = GaugeMetricFamily("ckpt_alert_active", "Alerts open and fired, by condition (pipeline/alerts.py)",
                               labels=["alert", "severity"])
    for name, n in alerts.counts(settings).items():
        active.add_metric([name, alerts.KINDS[name].severity], n)
    yield active
    letters = GaugeMetricFamily("ckpt_dead_letters", "Messages given up on after their retries (absent: the "
                                "broker could not be read)")
    try:
        letters.add_metric([], deadletters.summary(settings)[0])
    except Exception as exc:  # one line a scrape, not a traceback every 15 s while the broker is away
        log.warning("/metrics: could not count the dead letters: %s", exc)
    yield letters
    scrubbed = GaugeMetricFamily("ckpt_worker_last_scrub_timestamp_seconds", "When the storage worker's last "
                                 "scrub finished (Unix time)", labels=["worker"])
    for worker, at in sorted(doc["last_scrubs"].items()):
        scrubbed.add_metric([worker], at.timestamp())
    yield scrubbed


def _queue_metrics(settings: Any) -> Iterator[Any]:
    """Per queue: the messages in it (bounded: at most one per job step, none for a host that
    is down), whether a live consumer serves it, and the jobs waiting for its host."""
    depth = GaugeMetricFamily("ckpt_queue_depth", "Messages in the queue (waiting, being worked on or "
                              "waiting out a retry's delay)", labels=["queue"])
    if not settings.broker_url.startswith("stub://"):
        client = redis.Redis.from_url(settings.broker_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            for queue, n in sorted(queues.depths(client).items()):
                depth.add_metric([queue], n)
        except redis.RedisError as exc:  # the broker is away: the other metrics still answer
            log.warning("/metrics: could not read queue depths from the broker: %s", exc)
        finally:
            client.close()
    yield depth
    up = GaugeMetricFamily("ckpt_queue_consumer_up", "1 if a live Dramatiq worker consumes the queue",
                           labels=["queue", "host"])
    waiting = GaugeMetricFamily("ckpt_jobs_waiting_for_host", "Jobs whose next step waits for the host "
                                "of a queue no live worker consumes", labels=["queue"])
    with session_scope(settings.db_url, readonly=True) as session:
        live = set(consumers.live(session, settings))
        for queue, host in session.execute(select(QueueConsumer.queue, QueueConsumer.host)
                                           .order_by(QueueConsumer.queue)):
            up.add_metric([queue, host], 1 if queue in live else 0)
        for queue_waited, n in session.execute(select(Job.waiting_for, func.count(Job.id))
                                               .where(Job.waiting_for.is_not(None)).group_by(Job.waiting_for)):
            waiting.add_metric([str(queue_waited)], n)
    yield up
    yield waiting


def _capacity_metrics(doc: dict[str, Any]) -> Iterator[Any]:
    """Cluster usage, its forecast, and per run the stored bytes of the content it keeps."""
    cap = doc["capacity"]
    for name, key, text in (("ckpt_cluster_used_bytes", "used", "Bytes the storage workers' shards use"),
                            ("ckpt_cluster_capacity_bytes", "capacity", "Capacity of the readable storage workers"),
                            ("ckpt_cluster_limit_bytes", "limit", "Usage at which the cluster is full "
                             "(the high watermark)"),
                            ("ckpt_cluster_stored_bytes", "stored", "Bytes of the copies the control plane knows"),
                            ("ckpt_garbage_bytes", "garbage", "Stored bytes of content being collected")):
        g = GaugeMetricFamily(name, text)
        g.add_metric([], cap[key])
        yield g
    g = GaugeMetricFamily("ckpt_cluster_days_until_full", "Days until the high watermark at the recent rate "
                          "(absent when usage is not growing)")
    if cap["days_until_full"] is not None:
        g.add_metric([], cap["days_until_full"])
    yield g
    usage = GaugeMetricFamily("ckpt_run_stored_bytes", "Stored bytes of the content a run's kept checkpoints "
                              "reference (unique: no other run references it)", labels=["run", "kind"])
    for run, u in sorted(doc["run_usage"].items()):
        usage.add_metric([run, "unique"], u["unique"])
        usage.add_metric([run, "shared"], u["shared"])
    yield usage


def _detection_metrics(doc: dict[str, Any]) -> Iterator[Any]:
    """Per run: the newest protected step, its age, whether protection is behind; and the
    entries detection cannot protect, and the checkpoints that vanished unprotected."""
    step = GaugeMetricFamily("ckpt_run_protected_step", "Newest protected step of the run (-1: none yet)",
                             labels=["run"])
    age = GaugeMetricFamily("ckpt_run_protected_age_seconds",
                            "Age of the run's newest protected checkpoint: the work a node loss would cost",
                            labels=["run"])
    behind = GaugeMetricFamily("ckpt_run_protection_behind", "1 if the run's newest checkpoint waits too long",
                               labels=["run"])
    vanished = GaugeMetricFamily("ckpt_run_vanished_unprotected",
                                 "Checkpoints deleted before they were protected", labels=["run"])
    changed = GaugeMetricFamily("ckpt_run_changed_on_disk", "Checkpoints whose files on disk changed since their "
                                "recorded version, the new content not protected yet", labels=["run"])
    for r in doc["runs"]:
        changed.add_metric([r["run"]], r.get("changed_on_disk", 0))
        step.add_metric([r["run"]], r["protected_step"] if r["protected_step"] is not None else -1)
        if r["protected_age_s"] is not None:
            age.add_metric([r["run"]], r["protected_age_s"])
        behind.add_metric([r["run"]], 1 if r["behind"] else 0)
        vanished.add_metric([r["run"]], r["vanished_unprotected"])
    failing = GaugeMetricFamily("ckpt_run_protection_degraded", "Saves of the run its trainer integration "
                                "could not protect since protection last worked (absent: not degraded)",
                                labels=["run"])
    for d in doc["degraded"]:
        failing.add_metric([d["run"]], d["failures"])
    problems = GaugeMetricFamily("ckpt_detection_problems", "Entries of watched runs that are not protected "
                                 "(malformed, unreadable or stuck incomplete)")
    problems.add_metric([], len(doc["problems"]))
    yield from (step, age, behind, vanished, changed, failing, problems)


#: The states the step histograms read (every other event of the window,
#: most of them notes and later states, is left in the database: decoding 20,000 rows' times
#: was half of a scrape at 100k checkpoints).
_MARKS = ("sharded", "replicated", "verified", "queued", "done")


def _step_durations(session: Session) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"transfer": [], "verify": [], "restore": []}
    # The most recent events (the histograms describe recent transfers, and a month of
    # history must not be read at every scrape).
    recent = select(JobEvent.id).order_by(JobEvent.id.desc()).limit(20_000).subquery()
    rows = session.execute(select(JobEvent.job_id, Job.kind, JobEvent.to_state, JobEvent.at)
                           .join(Job, Job.id == JobEvent.job_id).where(JobEvent.id.in_(select(recent.c.id)))
                           .where(Job.kind.in_(("store", "restore")), JobEvent.to_state.in_(_MARKS))
                           .order_by(JobEvent.id))
    seen: dict[int, dict[str, Any]] = {}
    for job_id, kind, to_state, at in rows:
        seen.setdefault(job_id, {"kind": kind})[to_state] = at
    for marks in seen.values():
        if marks["kind"] == "store":
            if "sharded" in marks and "replicated" in marks:
                out["transfer"].append((marks["replicated"] - marks["sharded"]).total_seconds())
            if "replicated" in marks and "verified" in marks:
                out["verify"].append((marks["verified"] - marks["replicated"]).total_seconds())
        elif "queued" in marks and "done" in marks:
            out["restore"].append((marks["done"] - marks["queued"]).total_seconds())
    return out


@bp.get("/metrics")
def metrics() -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControlPlaneCollector(current_app.config["CKPT_SETTINGS"]))
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
