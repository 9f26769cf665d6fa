"""``ckpt status``: runs, checkpoints, problems, jobs and workers, as text or JSON."""
from __future__ import annotations

import argparse
import json
from datetime import datetime

from pipeline import states
from pipeline.cli.common import settings_from
from pipeline.cli.progress import age
from pipeline.core.health import ALARMING
from pipeline.core.retention import recency
from pipeline.db.transitions import now
from pipeline.states import WorkerState


def gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB"


def _checkpoint_table(rows: list[dict], t: datetime) -> None:
    """One run's checkpoints on this page, newest first (pipeline.core.retention.recency)."""
    if not rows:
        return
    rows = sorted(rows, key=lambda c: recency(c["written_at"].timestamp(), c["step"], c["id"]), reverse=True)
    print(f"    {'ID':>6}  {'STEP':>8}  {'WRITTEN':>11}  {'STATE':<11} {'REPLICAS':<14} {'HEALTH':<17} {'LOCAL':<22} "
          f"{'SIZE':>10}  NAME")
    for c in rows:
        reps = f"{c['replicas_verified']}/{c['replicas_wanted']} verified"
        # pipeline.core.health: the one health label (only an alarming one shouts) and local copy
        health = c["health"].upper() if c["health"] in ALARMING else c["health"]
        step = "-" if c["step"] is None else str(c["step"])
        written = age((t - c["written_at"]).total_seconds()) + " ago"
        local = c["local_copy"]
        print(f"    {c['id']:>6}  {step:>8}  {written:>11}  {c['state']:<11} {reps:<14} {health:<17} {local:<22} "
              f"{c['total_bytes'] / 1e6:>8.1f}MB  {c['name']}" + ("" if c["current"] else "  (older version)"))
        if c.get("disk_changed"):
            print(f"            !! CHANGED ON DISK, not protected: {c['disk_changed']}")
        if c.get("blocked_reason"):
            print(f"            {c['blocked_reason']}")
        if c.get("pinned"):
            print("            pinned" + (f": {c['pin_note']}" if c.get("pin_note") else ""))


def _degraded(rows: list[dict], t: datetime) -> None:
    """The runs whose trainer integration cannot protect their saves (pipeline.degraded)."""
    for d in rows:
        print(f"!! run {d['run']}: protection degraded since {d['since']:%Y-%m-%d %H:%M:%S} UTC "
              f"({age((t - d['since']).total_seconds())} ago; {d['failures']} failure(s), the last "
              f"{age((t - d['last']).total_seconds())} ago): {d['cause']}")
    if rows:
        print()


def _waiting(rows: list[dict]) -> None:
    """The entries the watcher sees but does not record yet (pipeline.detection.waits)."""
    if not rows:
        return
    print(f"\nwaiting to be recorded ({len(rows)}):")
    for w in rows:
        left = (f"recorded in {age(w['left_s'])} if nothing changes" if w["left_s"] is not None
                else f"incomplete for {age(w['waited_s'])}")
        print(f"  {w['path']}: {left}: {w['reason']}")


def cmd_status(args: argparse.Namespace) -> int:
    from pipeline.status import jsonable, status

    s = settings_from(args)
    from pipeline.db.migrate import upgrade

    upgrade(s.db_url)
    run = None
    if args.run:  # a path from here, as the catalog records it
        from pipeline.db.engine import session_scope
        from pipeline.detection.catalog import resolve_run

        with session_scope(s.db_url, readonly=True) as session:
            run = resolve_run(session, args.run)
    doc = status(s, all_versions=args.all, run=run, state=args.state, before=args.before, limit=args.limit,
                 search=args.search)
    if args.json:
        print(json.dumps(doc, indent=2, default=jsonable))
        return 0
    t = now()
    by_run: dict[str, list[dict]] = {}
    for c in doc["checkpoints"]:
        by_run.setdefault(c["run"], []).append(c)
    usage = doc["run_usage"]
    print("runs:" if doc["runs"] else "runs: none yet (a checkpoint written under a watched root starts one)")
    for r in doc["runs"]:
        if r["protected_name"] is None:
            point = "nothing protected yet"
        else:
            step = f"step {r['protected_step']}" if r["protected_step"] is not None else r["protected_name"]
            point = f"newest protected {step}, written {age(r['protected_age_s'])} ago"
        u = usage.get(r["run"], {"unique": 0, "shared": 0})
        print(f"  {r['run']}: {r['checkpoints']} checkpoint(s); {point}; "
              f"stores {gb(u['unique'])} unique + {gb(u['shared'])} shared")
        if r["policy_set"]:
            print(f"    remote retention: {r['policy']}")
        else:
            print("    remote retention: none set, every protected checkpoint is kept on the workers for ever "
                  "(set CKPT_REMOTE_KEEP_LAST, or a [runs] table in config.toml; `ckpt policy` previews it)")
        if r["behind"]:
            print(f"    !! {r['behind']}")
        if r["vanished_unprotected"]:
            print(f"    warning: deleted before it was protected: {r['vanished_unprotected']} checkpoint(s) (by the "
                  "trainer's own rotation, such as save_total_limit, or by hand, before their copies were verified)")
        if r.get("changed_on_disk"):
            print(f"    !! {r['changed_on_disk']} checkpoint(s) CHANGED ON DISK, the new content NOT PROTECTED "
                  "(saved again at the same path and not complete yet; a restore by path refuses them)")
        _checkpoint_table(by_run.pop(r["run"], []), t)
        print()
    for run, rows in by_run.items():  # a run the summaries did not list (none should be)
        print(f"  {run}:")
        _checkpoint_table(rows, t)
        print()
    if not doc["runs"]:
        print()
    _degraded(doc["degraded"], t)
    cap = doc["capacity"]
    forecast = cap["forecast"]
    print(f"capacity: {gb(cap['used'])} used of {gb(cap['capacity'])} on {cap['filesystems']} disk(s) of "
          f"{cap['workers']} worker(s) (each disk counted once), "
          f"high watermark at {gb(cap['limit'])}; {forecast}"
          + (f"; {cap['full_workers']} worker(s) FULL" if cap["full_workers"] else "")
          + (f"; {gb(cap['garbage'])} being collected" if cap["garbage"] else ""))
    if doc["next_before"]:
        print(f"  ... older checkpoints: `ckpt status --before {doc['next_before']}` (or --limit N, --run RUN, "
              "--state STATE, --search TEXT)")
    if doc["problems"]:
        print(f"\nnot protected ({len(doc['problems'])}):")
        for prob in doc["problems"]:
            print(f"  {prob['path']}: {prob['reason']}")
    _waiting(doc["waiting"])
    lost = [c for c in doc["checkpoints"] if c["health"] == "lost"]
    if lost:
        print(f"\n!!! {len(lost)} checkpoint(s) have LOST shards (no copy matches the manifest): "
              + ", ".join(str(c["id"]) for c in lost))
    active = [j for j in doc["jobs"] if j["state"] in states.ACTIVE[j["kind"]] or j["state"] == "failed"]
    if active:
        print("\njobs not finished:")
        for j in active:
            print(f"  job {j['id']:>4} {j['kind']:<8} {j['state']:<11} attempts {j['attempts']}"
                  + (f"  last error: {j['last_error']}" if j["last_error"] else ""))
    me = doc["this_host"]
    print(f"\ntraining hosts (this one: {me['id']}" + (f", hostname {me['label']}" if me["label"] != me["id"] else "")
          + "):")
    for h in doc["hosts"]:
        label = f" ({h['label']})" if h["label"] and h["label"] != h["id"] else ""
        consumer = "consumer running" if h["consumer_live"] else "no consumer: a restore there is refused"
        print(f"  {h['id']}{label}: seen {h['last_seen']:%Y-%m-%d %H:%M:%S}, {consumer}")
    print("\nstorage workers:")
    for w in doc["workers"]:
        failing = w["state"] in (WorkerState.DOWN, WorkerState.REJECTED) and w["last_error"]
        why = f"  ({w['last_error']})" if failing else ""
        print(f"  {w['id']:<16} {w['state']:<10} {w['source']:<7} {w['url']:<28} "
              f"used {gb(w['used_bytes'])}, free {gb(w['free_bytes'])} of {gb(w['capacity_bytes'])}" + why)
    return 0
