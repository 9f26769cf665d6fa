"""``ckpt pin``, ``unpin``, ``forget``, ``gc`` and ``policy``: what stays on the storage workers."""
from __future__ import annotations

import argparse

from pipeline.cli.common import control_plane, settings_from
from pipeline.cli.progress import wait_job
from pipeline.units import human_bytes


def cmd_pin(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    control_plane(s)
    cid, path = operations.pin(s, args.checkpoint, args.note, pinned=True)
    print(f"checkpoint {cid} ({path}) is pinned: the retention policy and `ckpt forget` keep it")
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    control_plane(s)
    cid, path = operations.pin(s, args.checkpoint, pinned=False)
    print(f"checkpoint {cid} ({path}) is no longer pinned")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    control_plane(s)
    verdicts = operations.forget(s, args.checkpoint, dry_run=args.dry_run)
    verb = "would forget" if args.dry_run else "forgot"
    for v in verdicts:
        print(f"{verb} checkpoint {v.checkpoint_id}: {v.path} ({human_bytes(v.bytes)})")
    print(("they would" if args.dry_run else "they") + " no longer be restorable. " + LAST_COPY.format(
        grace=s.gc_grace_seconds, keep=s.keep_last))
    return 0


#: What forgetting means for the bytes, said before and after (`ckpt forget`, `ckpt policy`).
LAST_COPY = ("Their content is deleted from the workers by the first collection after {grace:.0f} s once "
             "their local copies are gone (`ckpt gc` runs one now): a local copy still on the training disk "
             "is then the ONLY copy, and the local policy (keep the newest {keep} per run) rotates it "
             "like any other.")


def cmd_policy(args: argparse.Namespace) -> int:
    """What the remote retention policy keeps of each run, and why."""
    from sqlalchemy import select

    from pipeline.db.engine import session_scope
    from pipeline.db.models import Checkpoint
    from pipeline.detection.catalog import resolve_run
    from pipeline.integrity import retention

    s = settings_from(args)
    control_plane(s)
    with session_scope(s.db_url, readonly=True) as session:
        runs = [resolve_run(session, args.run)] if args.run else list(session.scalars(
            select(Checkpoint.run).distinct().order_by(Checkpoint.run)))
        for run in runs:
            policy = s.policy_for(run)
            print(f"{run}: remote retention {policy.describe()}")
            copies, mode = s.target_policy(run)
            print(f"  placement: RF {s.rf_for(run)} on storage workers"
                  + (f", {copies} on object stores ({mode})" if copies else ""))
            verdicts = retention.plan_run(session, s, run)
            for v in verdicts:
                mark = "keep  " if v.keep else "forget"
                print(f"  {mark} {v.checkpoint_id:>6}  step {v.step if v.step is not None else '-':>8}  "
                      f"{human_bytes(v.bytes):>11}  {v.why}  {v.path}")
            if any(not v.keep for v in verdicts):
                print("  forgotten checkpoints are no longer restorable. " + LAST_COPY.format(
                    grace=s.gc_grace_seconds, keep=s.keep_last))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    control_plane(s)
    result = operations.collect_garbage(s, args.worker or None, dry_run=args.dry_run, reason="ckpt gc")
    if args.dry_run:
        if not result.freed:
            print("nothing to collect: every content on the workers is referenced by a kept checkpoint "
                  f"(or was released less than {s.gc_grace_seconds:.0f} s ago)")
        for f in result.freed:
            print(f"storage worker {f.worker_id} ({f.state}): would delete {f.copies} copies, {human_bytes(f.bytes)}")
        if result.freed:
            freed = sum(f.bytes for f in result.freed)
            print(f"total: {sum(f.copies for f in result.freed)} copies, {human_bytes(freed)}")
        return 0
    print(f"marked {result.condemned} contents ({human_bytes(result.condemned_bytes)}) as garbage")
    if not result.jobs:
        print("no storage worker holds garbage")
        return 0
    for r in result.jobs:
        print(f"collection job {r.job_id}: storage worker {r.detail}")
    if not args.wait:
        return 0
    return max(wait_job(s, r.job_id, ok=("done",), timeout=args.timeout) for r in result.jobs)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pin", help="keep a checkpoint remotely whatever the retention policy says")
    p.add_argument("checkpoint", help="checkpoint id or path")
    p.add_argument("--note", help="why it is kept (shown in status and the UI)")
    p.set_defaults(func=cmd_pin)

    u = sub.add_parser("unpin", help="let the retention policy decide for a pinned checkpoint again")
    u.add_argument("checkpoint", help="checkpoint id or path")
    u.set_defaults(func=cmd_unpin)

    f = sub.add_parser("forget", help="stop keeping checkpoints remotely (they can no longer be restored)")
    f.add_argument("checkpoint", nargs="+", help="checkpoint ids or paths")
    f.add_argument("--dry-run", action="store_true", help="say what would be forgotten, change nothing")
    f.set_defaults(func=cmd_forget)

    pol = sub.add_parser("policy", help="what the remote retention policy keeps of each run, and why")
    pol.add_argument("run", nargs="?", help="only this run directory")
    pol.set_defaults(func=cmd_policy)

    g = sub.add_parser("gc", help="delete content no kept checkpoint references from the storage workers")
    g.add_argument("--dry-run", action="store_true", help="print what would be freed per worker, delete nothing")
    g.add_argument("--worker", action="append", help="only this worker (repeatable)")
    g.add_argument("--wait", action="store_true", help="wait until every worker's collection is done")
    g.add_argument("--timeout", type=float, default=24 * 3600.0)
    g.set_defaults(func=cmd_gc)
