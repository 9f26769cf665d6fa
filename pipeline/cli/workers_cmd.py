"""``ckpt workers``: list the storage workers, drain one (and wait), undrain, remove.

Every change goes through :mod:`pipeline.operations` (what the web UI's drain uses too), and so
through :func:`pipeline.db.workers.set_state`, the one mover of a worker's state.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

from pipeline.cli.common import settings_from
from pipeline.cli.progress import age
from pipeline.errors import CkptError
from pipeline.settings import Settings
from pipeline.units import human_bytes


def worker_rows(s: Settings) -> list[dict[str, Any]]:
    """Every storage worker with the copies it holds (the web UI's /api/workers rows)."""
    from sqlalchemy import select

    from pipeline.db.copies import held_per_worker
    from pipeline.db.engine import session_scope
    from pipeline.db.models import StorageWorker
    from pipeline.status import worker_dict

    with session_scope(s.db_url, readonly=True) as session:
        held = held_per_worker(session)
        return [worker_dict(w) | {"copies": held.get(w.id, (0, 0))[0], "copies_bytes": held.get(w.id, (0, 0))[1]}
                for w in session.scalars(select(StorageWorker).order_by(StorageWorker.id))]


def print_workers(rows: list[dict[str, Any]]) -> None:
    from pipeline.db.transitions import now

    if not rows:
        print("no storage workers yet (`ckpt up` starts 3; `ckpt worker --data DIR --port P` runs one)")
        return
    t = now()
    print(f"{'ID':<16} {'STATE':<10} {'ZONE':<8} {'USED':>9} {'FREE':>9} {'COPIES':>7} {'LAST SEEN':>11}  URL")
    for w in rows:
        seen = "never" if w["last_seen"] is None else age((t - w["last_seen"]).total_seconds()) + " ago"
        print(f"{w['id']:<16} {w['state']:<10} {w['zone'] or '-':<8} {human_bytes(w['used_bytes']):>9} "
              f"{human_bytes(w['free_bytes']):>9} {w['copies']:>7,} {seen:>11}  {w['url']}")
        if w["last_error"]:
            print(f"{'':<16} last error: {w['last_error']}")


def cmd_workers(args: argparse.Namespace) -> int:
    from pipeline import operations
    from pipeline.db.migrate import upgrade

    s = settings_from(args)
    upgrade(s.db_url)  # sends nothing: the scheduler moves the copies
    action, ids = args.action, args.ids
    if action == "list" or action is None:
        rows = worker_rows(s)
        if args.json:
            from pipeline.status import jsonable

            print(json.dumps(rows, indent=2, default=jsonable))
        else:
            print_workers(rows)
        return 0
    if len(ids) != 1:
        raise CkptError(f"`ckpt workers {action}` takes one worker id (`ckpt workers` lists them)")
    worker_id = ids[0]
    if action == "drain":
        operations.drain(s, worker_id)
        p = operations.drain_progress(s, worker_id)
        if p.state == "removable":
            print(f"storage worker {worker_id} is drained (removable): stop it, then `ckpt workers remove {worker_id}`")
            return 0
        print(f"storage worker {worker_id} is draining: its copies are made on other workers, then it is "
              "removable" + ("" if args.wait else f"; `ckpt workers drain {worker_id} --wait` follows it"))
        return wait_drained(s, worker_id, args.timeout) if args.wait else 0
    if action == "undrain":
        was = operations.undrain(s, worker_id)
        print(f"storage worker {worker_id} is no longer {was}: it rejoins at its next good probe (reconciled "
              "first), then takes copies again")
        return 0
    if action == "remove":
        from pipeline.cluster.membership import answers_as

        r = operations.remove(s, worker_id, answers=lambda url, node: answers_as(s, url, node))
        print(f"storage worker {worker_id} ({r.state}, {r.url}) removed, with its {r.copies} copy record(s)")
        if r.short:
            print(f"  {r.short} content(s) have fewer than {s.rf_said()} good copies without it: the scheduler's "
                  "repair copies them (`ckpt status` shows their replicas)")
        return 0
    raise CkptError(f"unknown action {action!r}: ckpt workers [list | drain ID [--wait] | undrain ID | remove ID]")


def wait_drained(s: Settings, worker_id: str, timeout: float) -> int:
    """Follow a drain until the worker is removable: the copies still to make, as they go.

    Ctrl-C sets a flag the loop reads between polls (a KeyboardInterrupt raised inside the
    database driver can be swallowed by its clean-up, and the wait would then go on for ever)."""
    from pipeline import operations

    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    deadline = time.monotonic() + timeout
    last: tuple[str, int] | None = None
    try:
        while not stop.is_set():
            p = operations.drain_progress(s, worker_id)
            if p.state == "removable":
                print(f"storage worker {worker_id} is drained (removable): every content it held has "
                      f"{s.rf_said()} good copies elsewhere; stop it, then `ckpt workers remove {worker_id}`",
                      flush=True)
                return 0
            if p.state != "draining":
                print(f"storage worker {worker_id} is {p.state} now, not draining (undrained?)", file=sys.stderr)
                return 1
            if (p.state, p.left) != last:
                print(f"  {worker_id}: {p.left:,} of {p.held:,} content(s) ({human_bytes(p.left_bytes)}) still to copy "
                      "elsewhere", flush=True)
                last = (p.state, p.left)
            if time.monotonic() > deadline:
                print(f"storage worker {worker_id} still draining after {timeout:.0f} s ({p.left:,} left); it goes "
                      "on in the background", file=sys.stderr)
                return 2
            stop.wait(0.5)
    finally:
        signal.signal(signal.SIGINT, previous)
    print(f"\nstopped waiting: storage worker {worker_id} is still draining (the scheduler goes on copying); "
          f"`ckpt workers` shows it, `ckpt workers undrain {worker_id}` cancels the drain", file=sys.stderr)
    return 130


def add_parser(sub: Any) -> None:
    w = sub.add_parser("workers", help="the storage workers: list, drain [--wait], undrain, remove",
                       description="ckpt workers [list] | drain ID [--wait] | undrain ID | remove ID")
    w.add_argument("action", nargs="?", choices=("list", "drain", "undrain", "remove"))
    w.add_argument("ids", nargs="*", metavar="ID")
    w.add_argument("--wait", action="store_true", help="drain: wait until it is removable, with progress")
    w.add_argument("--timeout", type=float, default=24 * 3600.0)
    w.add_argument("--json", action="store_true", help="list: as JSON")
    w.set_defaults(func=cmd_workers)
