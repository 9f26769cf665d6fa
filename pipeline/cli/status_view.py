"""``ckpt status``: runs, checkpoints, problems, jobs and workers, as text or JSON."""
from __future__ import annotations

import argparse
import json

from pipeline import states
from pipeline.cli.common import settings_from
from pipeline.cli.progress import age
from pipeline.states import WorkerState


def cmd_status(args: argparse.Namespace) -> int:
    from pipeline.status import status

    s = settings_from(args)
    from pipeline.db.migrate import upgrade

    upgrade(s.db_url)
    doc = status(s, all_versions=args.all)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
        return 0
    if doc["runs"]:
        print("runs:")
        for r in doc["runs"]:
            if r["protected_name"] is None:
                point = "nothing protected yet"
            else:
                step = f"step {r['protected_step']}" if r["protected_step"] is not None else r["protected_name"]
                point = f"newest protected {step}, written {age(r['protected_age_s'])} ago"
            print(f"  {r['run']}: {r['checkpoints']} checkpoint(s); {point}")
            if r["behind"]:
                print(f"    !! {r['behind']}")
            if r["vanished_unprotected"]:
                print(f"    !! {r['vanished_unprotected']} checkpoint(s) vanished unprotected "
                      "(deleted before their copies were verified)")
        print()
    print(f"{'ID':>4}  {'STATE':<11} {'REPLICAS':<14} {'HEALTH':<17} {'LOCAL':<7} {'SIZE':>10}  PATH")
    for c in doc["checkpoints"]:
        reps = f"{c['replicas_verified']}/{c['replicas_wanted']} verified"
        health = c["health"].upper() if c["health"] == "lost" else c["health"]
        local = "kept" if c["local_present"] else "rotated"
        state = "VANISHED" if c["state"] == "vanished" else c["state"]
        print(f"{c['id']:>4}  {state:<11} {reps:<14} {health:<17} {local:<7} "
              f"{c['total_bytes'] / 1e6:>8.1f}MB  {c['path']}" + ("" if c["current"] else "  (older version)"))
        if c.get("blocked_reason"):
            print(f"      {c['blocked_reason']}")
    if doc["problems"]:
        print(f"\nnot protected ({len(doc['problems'])}):")
        for prob in doc["problems"]:
            print(f"  {prob['path']}: {prob['reason']}")
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
    print("\nstorage workers:")
    for w in doc["workers"]:
        failing = w["state"] in (WorkerState.DOWN, WorkerState.REJECTED) and w["last_error"]
        why = f"  ({w['last_error']})" if failing else ""
        print(f"  {w['id']:<16} {w['state']:<10} {w['source']:<7} {w['url']:<28} free {w['free_bytes'] / 1e9:,.1f} GB"
              + why)
    return 0
