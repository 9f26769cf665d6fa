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
from pipeline.objectstore import report as objectstore_report
from pipeline.states import WorkerState
from pipeline.units import human_bytes


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
              f"{human_bytes(c['total_bytes']):>10}  {c['name']}" + ("" if c["current"] else "  (older version)"))
        if c.get("objectstore"):
            print(f"            {objectstore_report.words(c['objectstore'])}")
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
    # A filter or a page asks for the checkpoint table: the full view.
    detail = bool(args.detail or args.all or args.run or args.state or args.search or args.before)
    doc = status(s, all_versions=args.all, run=run, state=args.state, before=args.before, limit=args.limit,
                 search=args.search, run_usage=detail or args.json)
    if args.json:
        print(json.dumps(doc, indent=2, default=jsonable))
        return 0
    if detail:
        full(doc)
    else:
        compact(doc)
    return 0


def _run_problems(doc: dict, r: dict) -> list[str]:
    """What is wrong with one run, in a few words each (the full view says each at length)."""
    out = []
    if r["behind"]:
        out.append("protection BEHIND")
    lost = sum(1 for c in doc["checkpoints"] if c["run"] == r["run"] and c["health"] == "lost")
    if lost:
        out.append(f"{lost} LOST")
    failed = r["by_state"].get(states.StoreState.FAILED.value, 0)
    if failed:
        out.append(f"{failed} failed")
    if r.get("changed_on_disk"):
        out.append(f"{r['changed_on_disk']} CHANGED ON DISK")
    if r["vanished_unprotected"]:
        out.append(f"{r['vanished_unprotected']} deleted before protected")
    unprotected = sum(1 for p in doc["problems"] if p["run"] == r["run"])
    if unprotected:
        out.append(f"{unprotected} not protected")
    if any(d["run"] == r["run"] for d in doc["degraded"]):
        out.append("trainer protection degraded")
    return out


def _cluster_line(doc: dict) -> str:
    """One line of cluster health: workers, capacity, unfinished work, and what needs a look."""
    ws = [w for w in doc["workers"] if w.get("tier", states.Tier.WORKERS) == states.Tier.WORKERS]
    live = sum(1 for w in ws if w["state"] in states.COUNTING_WORKERS)
    listed = [w for w in ws if w["state"] != WorkerState.REMOVABLE]
    others: dict[str, int] = {}
    for w in listed:
        if w["state"] not in states.COUNTING_WORKERS:
            others[w["state"]] = others.get(w["state"], 0) + 1
    cap = doc["capacity"]
    jobs = [j for j in doc["jobs"] if j["state"] in states.ACTIVE[j["kind"]]]
    failed_jobs = [j for j in doc["jobs"] if j["state"] == "failed"]
    alarms = []
    if not live:
        alarms.append("no storage worker up")
    alarms += [f"{n} worker(s) {state.upper() if state in ('down', 'rejected') else state}"
               for state, n in sorted(others.items())]
    if cap["full_workers"]:
        alarms.append(f"{cap['full_workers']} worker(s) FULL")
    lost = sum(1 for c in doc["checkpoints"] if c["health"] == "lost")
    if lost:
        alarms.append(f"{lost} checkpoint(s) LOST")
    if failed_jobs:
        alarms.append(f"{len(failed_jobs)} failed job(s)")
    if doc["problems"]:
        alarms.append(f"{len(doc['problems'])} not protected")
    health = "healthy" if not alarms else "ATTENTION: " + ", ".join(alarms)
    line = (f"cluster: {health} | {live} of {len(listed)} storage worker(s) up | {human_bytes(cap['used'])} used of "
            f"{human_bytes(cap['capacity'])} | {len(jobs)} job(s) running")
    stores = doc.get("objectstores", [])
    if stores:
        up = sum(1 for o in stores if o["state"] in states.COUNTING_WORKERS)
        line += f" | {up} of {len(stores)} object store(s) up"
    return line


def _objectstores(doc: dict) -> None:
    """The object-store tier: per target its state, what it holds against its quota, its copies."""
    if not doc.get("objectstores"):
        return
    print("\nobject stores:")
    for o in doc["objectstores"]:
        quota = f" of {human_bytes(o['quota_bytes'])} quota" if o["quota_bytes"] else " (no quota)"
        why = f"  ({o['last_error']})" if o["state"] not in states.COUNTING_WORKERS and o["last_error"] else ""
        print(f"  {o['id']:<16} {o['state']:<10} {o['url']:<28} used {human_bytes(o['used_bytes'])}{quota}, "
              f"{o['copies']} copies" + why)


def compact(doc: dict) -> None:
    """One line of cluster health, then one line per run."""
    t = now()
    print(_cluster_line(doc))
    if not doc["runs"]:
        print("runs: none yet (a checkpoint written under a watched root starts one)")
    else:
        rows = []
        for r in doc["runs"]:
            newest = r["newest_name"] + (f" (step {r['newest_step']})" if r["newest_step"] is not None
                                         and str(r["newest_step"]) not in r["newest_name"] else "")
            by = r["by_state"]
            total = r["checkpoints"] - by.get(states.StoreState.FORGOTTEN.value, 0)
            protected = sum(n for state, n in by.items() if state in states.PROTECTED)
            rows.append((r["run"], f"{newest} {r['newest_state']}", f"{protected}/{total}",
                         "; ".join(_run_problems(doc, r)) or "-"))
        w_run = max(len("RUN"), *(len(x[0]) for x in rows))
        w_new = max(len("NEWEST"), *(len(x[1]) for x in rows))
        print(f"{'RUN':<{w_run}}  {'NEWEST':<{w_new}}  {'PROTECTED':>9}  PROBLEMS")
        for run, newest, counted, said in rows:
            print(f"{run:<{w_run}}  {newest:<{w_new}}  {counted:>9}  {said}")
    if doc["degraded"]:
        print()
    _degraded(doc["degraded"], t)
    print("(`ckpt status --verbose`: every checkpoint, problem and job; `ckpt workers`: the storage workers)")


def full(doc: dict) -> None:
    """Everything: runs with their checkpoints, capacity, problems, jobs, hosts and workers."""
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
              f"stores {human_bytes(u['unique'])} unique + {human_bytes(u['shared'])} shared")
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
    print(f"capacity: {human_bytes(cap['used'])} used of {human_bytes(cap['capacity'])} on "
          f"{cap['filesystems']} disk(s) of "
          f"{cap['workers']} worker(s) (each disk counted once), "
          f"high watermark at {human_bytes(cap['limit'])}; {forecast}"
          + (f"; {cap['full_workers']} worker(s) FULL" if cap["full_workers"] else "")
          + (f"; {human_bytes(cap['garbage'])} being collected" if cap["garbage"] else ""))
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
        if w.get("tier", states.Tier.WORKERS) != states.Tier.WORKERS:
            continue
        failing = w["state"] in (WorkerState.DOWN, WorkerState.REJECTED) and w["last_error"]
        why = f"  ({w['last_error']})" if failing else ""
        print(f"  {w['id']:<16} {w['state']:<10} {w['source']:<7} {w['url']:<28} "
              f"used {human_bytes(w['used_bytes'])}, free {human_bytes(w['free_bytes'])} "
              f"of {human_bytes(w['capacity_bytes'])}" + why)
    _objectstores(doc)
