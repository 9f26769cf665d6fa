"""``ckpt``: the command line.

    ckpt up [--root DIR]... [--workers N]                everything on one machine
    (every command takes --home DIR, before or after its name; see pipeline/home.py)
    ckpt worker --data DIR --port P [--host H]           a storage worker daemon
    ckpt store PATH [--wait]                             protect a checkpoint now
    ckpt restore ID|PATH --to DEST [--host H] [--wait]   give a checkpoint back (on host H)
    ckpt status [--verbose] [--json] [--all]             one line per run; --verbose: every table
    ckpt scrub [--wait]                                  re-hash (read back) every copy now
    ckpt workers [drain ID [--wait] | undrain ID | remove ID]   the storage workers
    ckpt pin ID [--note T] | ckpt unpin ID               keep a checkpoint whatever the policy
    ckpt forget ID... [--dry-run]                        stop keeping checkpoints remotely
    ckpt policy [RUN]                                    what the retention policy keeps, and why
    ckpt gc [--dry-run] [--wait]                         delete unreferenced content from workers
    ckpt dead-letters [--requeue ID|all]                 failed messages
    ckpt config [--json]                                 each setting and where it came from
    ckpt target [add s3://B/P [--endpoint U] | list [--check] | remove NAME]   object-store targets
    ckpt scheduler | ckpt watch | ckpt migrate           the services ckpt up runs
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence

from pipeline import settings as settings_mod
from pipeline import states
from pipeline.cli.common import (
    HOME_HELP,
    add_home_option,
    collection_paused,
    control_plane,
    explained,
    parse_size,
    send,
    settings_from,
    stop_on_signals,
)
from pipeline.cli.config_cmd import add_parser as add_config_parser
from pipeline.cli.progress import wait_job, watching
from pipeline.cli.retention_cmds import add_parsers as add_retention_parsers
from pipeline.cli.target_cmd import add_parser as add_target_parser
from pipeline.cli.workers_cmd import add_parser as add_workers_parser
from pipeline.errors import CkptError
from pipeline.masking import masked_url
from pipeline.settings import Settings

log = logging.getLogger("ckpt")


# -- commands ------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from pipeline.service.supervisor import Supervisor

    # Not over an earlier `ckpt up`'s record: this one's settings are what it records.
    s, sources = explained(args, create=True, recorded=False, web_port=args.web_port)
    if not s.roots:
        # Quick start: watch ./checkpoints (a run: each entry in it is one checkpoint).
        import dataclasses

        s = settings_mod.configure(dataclasses.replace(s, roots=(os.path.abspath("checkpoints"),)))
    existed = (s.home / "ckpt.db").exists() or (s.home / "config.toml").exists()
    sup = Supervisor(s, sources=sources, workers=args.workers, processes=args.processes, threads=args.threads)
    stop = threading.Event()

    def request_stop() -> None:
        stop.set()
        sup.stopping = True

    stop_on_signals(request_stop)
    try:
        info = sup.up()
        print(f"ckpt up: home {info['home']}" + ("" if existed else " (new: commands run in this directory or"
                                                 " below find it; elsewhere pass --home or set CKPT_HOME)"), flush=True)
        print(f"  control plane  {masked_url(info['database'])}", flush=True)
        print(f"  broker         {masked_url(info['broker'])}", flush=True)
        for url in info["workers"]:
            print(f"  storage worker {url}", flush=True)
        print(f"  watching       {', '.join(s.roots)}", flush=True)
        if info.get("web"):
            print(f"  web UI         {info['web']}  (admin token: {s.admin_token()})", flush=True)
        print("  logs           " + str(sup.home / "logs"), flush=True)
        print("ready: new checkpoints under the roots are protected; Ctrl-C stops everything", flush=True)
        if not stop.is_set():
            sup.supervise()
    finally:
        print("ckpt up: stopping", flush=True)
        sup.shutdown()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    s = settings_from(args, create=True)
    if args.action:
        return _worker_action(s, args.action)
    if not args.data or not args.port:
        raise CkptError("ckpt worker needs --data DIR and --port P (or an action: `ckpt worker drain ID`)")
    from workers.server import serve

    advertise = s.mdns_interfaces if (s.mdns and not args.no_advertise) else ()
    serve(os.path.abspath(args.data), host=args.host, port=args.port, key=s.key(), zone=args.zone or "",
          threads=args.threads, capacity=args.capacity, max_skew=s.clock_skew_seconds, max_upload=s.worker_max_upload,
          advertise_on=advertise, urls=tuple(args.url or ()), compress=s.wire_compression)
    return 0


def _worker_action(s: Settings, action: list[str]) -> int:
    """``ckpt worker drain ID``, kept for scripts: ``ckpt workers drain ID``."""
    from pipeline import operations
    from pipeline.db.migrate import upgrade

    if len(action) != 2 or action[0] != "drain":
        raise CkptError(f"unknown worker action {' '.join(action)!r}; try `ckpt workers drain ID`")
    upgrade(s.db_url)
    operations.drain(s, action[1])
    print(f"storage worker {action[1]} is draining: its shards are copied to other workers; "
          f"`ckpt workers drain {action[1]} --wait` follows it until it is removable")
    return 0


def cmd_scrub(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    control_plane(s)
    started = operations.scrub_now(s, args.worker or None, reason="ckpt scrub")
    if not started:
        print("no live storage worker to scrub")
        return 1
    for r in started:
        print(f"scrub job {r.job_id}: storage worker {r.detail}")
    if not args.wait:
        return 0
    return max(wait_job(s, r.job_id, ok=("done",), timeout=args.timeout) for r in started)


def cmd_status(args: argparse.Namespace) -> int:
    # Imported when run: the status queries bring SQLAlchemy and the models, which a storage
    # worker (``ckpt worker``, started by every ``ckpt up``) never needs (docs/design.md,
    # "Start-up").
    with collection_paused():
        from pipeline.cli.status_view import cmd_status as status

        return status(args)


def cmd_scheduler(args: argparse.Namespace) -> int:
    from pipeline.service.scheduler import Scheduler

    s = settings_from(args, create=True)
    control_plane(s)
    sched = Scheduler(s, send)
    stop_on_signals(lambda: sched.stopping.set())
    sched.run()
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from pipeline.detection.watcher import Watcher

    s = settings_from(args, create=True)
    control_plane(s)
    w = Watcher(s, send)
    stop_on_signals(w.stop)
    w.run()
    return 0


def cmd_web(args: argparse.Namespace) -> int:
    from pipeline.service.serving import run
    from webui import create_app

    s = settings_from(args, create=True, web_host=args.host, web_port=args.port)
    control_plane(s)
    # Live-update streams may hold at most half of the threads: the pages always get the rest.
    app = create_app({"CKPT_STREAMS": max(1, args.threads // 2)}, settings=s)
    print(f"web UI on http://{s.web_host}:{s.web_port}/", flush=True)
    # Open event streams (the pages' live updates) never finish by themselves: a stop
    # should not wait the default 10 s for them.
    run(app, host=s.web_host, port=s.web_port, threads=args.threads, name="ckpt-web", graceful_timeout=2)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from pipeline.db.migrate import upgrade

    s = settings_from(args, create=True)
    upgrade(s.db_url)
    print(f"{masked_url(s.db_url)}: at head")
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    control_plane(s)
    r = operations.store(s, args.path, detail="requested by ckpt store")
    if r.created:
        print(f"checkpoint {r.checkpoint_id}: store job {r.job_id} created for {r.detail}")
    else:
        print(f"checkpoint {r.checkpoint_id}: this version is already known (job {r.job_id}, {r.state})")
    if args.wait:
        return wait_job(s, r.job_id, ok=tuple(states.PROTECTED), timeout=args.timeout)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from pipeline import operations

    s = settings_from(args)
    # Waited for on this host: run here (operations.restore_here), no message to wait for;
    # the broker and the actors are needed only if this attempt hands the job over.
    here = args.wait and args.host in (None, s.host_id)
    if here:
        from pipeline.db.migrate import upgrade

        upgrade(s.db_url)
    else:
        control_plane(s)
    ref = args.checkpoint
    if args.latest:
        if ref:
            raise CkptError("give either a checkpoint or --latest RUN, not both")
        from pipeline.api import latest

        newest = latest(args.latest, settings=s)
        if newest is None:
            raise CkptError(f"run {args.latest} has no protected checkpoint; `ckpt status` shows its checkpoints")
        step = f"step {newest.step}, " if newest.step is not None else ""
        if newest.parts:  # one save of several files side by side: each back into the folder --to
            print(f"newest protected save of {args.latest}: {newest.path} and its {len(newest.parts)} shards "
                  f"({step}ids {', '.join(str(p.id) for p in (*newest.parts, newest))}), into the folder {args.to}")
            wanted = [(str(p.id), os.path.join(args.to, os.path.basename(p.path))) for p in (*newest.parts, newest)]
            operations.check_restores(s, wanted, overwrite=args.overwrite, from_here=True, host=args.host)
            return _restoring(args, s, here, wanted)
        ref = str(newest.id)
        print(f"newest protected checkpoint of {args.latest}: {newest.path} ({step}id {newest.id})")
    elif not ref:
        raise CkptError("give the checkpoint to restore (an id or a path), or --latest RUN")
    return _restoring(args, s, here, [(ref, args.to)])


def _restoring(args: argparse.Namespace, s: Settings, here: bool, wanted: list[tuple[str, str]]) -> int:
    """Restore each (checkpoint, destination) of ``wanted``: waited for, one after the other
    (the files of one save in the order given: its index last), each recorded only when its
    turn comes, run here on this host, and a failure ends the rest unrecorded; else all sent at
    once."""
    from pipeline import operations

    for ref, dest in wanted:
        r = operations.restore_to(s, ref, dest, overwrite=args.overwrite, from_here=True, host=args.host,
                                  send=not here)
        print(f"restore job {r.job_id}: checkpoint {ref} -> {r.detail} on host {args.host or s.host_id}", flush=True)
        if not r.sent:
            print("  recorded, but the broker does not answer now (`ckpt up` restarting?): it starts once it is back",
                  file=sys.stderr)
        if here:
            operations.restore_here(s, r.job_id, watching(states.RestoreState.GATHERING))
        if args.wait and (rc := wait_job(s, r.job_id, ok=("done",), timeout=args.timeout)):
            return rc
    return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    s = settings_from(args)
    control_plane(s)
    from pipeline.status import jsonable
    from pipeline.tasks import deadletters
    if args.requeue:
        ids = None if args.requeue == "all" else [args.requeue]
        n = deadletters.requeue(s, ids)
        print(f"requeued {n} message(s)")
        return 0 if n else 1
    letters = deadletters.list_letters(s)
    if args.json:
        print(json.dumps(letters, indent=2, default=jsonable))
        return 0
    if not letters:
        print("no dead letters")
    for d in letters:
        print(f"{d['id']}  {d['actor']}{tuple(d['args'])}  {d['error'] or ''}")
    return 0


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt", description="Protect training checkpoints.")
    p.add_argument("--home", help=HOME_HELP)
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run everything on this machine (embedded SQLite and Redis)")
    up.add_argument("--root", action="append",
                    help="watched root: a run directory or a glob of them (default ./checkpoints)")
    up.add_argument("--workers", type=int, default=3, help="local storage workers (default 3)")
    up.add_argument("--processes", type=int, default=2, help="dramatiq worker processes (default 2)")
    up.add_argument("--threads", type=int, default=4, help="threads per dramatiq process (default 4)")
    up.add_argument("--web-port", type=int, help="web UI port (default 8080; 0 disables the web UI)")
    up.set_defaults(func=cmd_up)

    w = sub.add_parser("worker", help="run a storage worker daemon, or `ckpt worker drain ID`")
    w.add_argument("action", nargs="*", help="drain ID: copy the worker's shards elsewhere, then mark it removable")
    w.add_argument("--data", help="directory holding this worker's shards")
    w.add_argument("--port", type=int)
    w.add_argument("--no-advertise", action="store_true", help="do not announce the worker on mDNS")
    w.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    w.add_argument("--zone", help="failure zone advertised to placement")
    w.add_argument("--url", action="append", metavar="URL",
                   help="a URL this worker is also reached at (a port forward or NAT); repeatable. Its own port on "
                        "this host's addresses always counts; it proves itself for no other URL")
    w.add_argument("--threads", type=int, default=8)
    w.add_argument("--capacity", type=parse_size, default=0,
                   help="most bytes this worker's shards may use, e.g. 500G (default: the whole disk)")
    w.set_defaults(func=cmd_worker)

    st = sub.add_parser("store", help="protect one checkpoint now")
    st.add_argument("path")
    st.add_argument("--root", action="append", help="watched root (default: CKPT_ROOTS)")
    st.add_argument("--wait", action="store_true", help="wait until verified, with progress")
    st.add_argument("--timeout", type=float, default=3600.0)
    st.set_defaults(func=cmd_store)

    r = sub.add_parser("restore", help="give a checkpoint back byte for byte")
    r.add_argument("checkpoint", nargs="?", help="checkpoint id or path (a path means its current version)")
    r.add_argument("--latest", metavar="RUN", help="the newest protected checkpoint of this run (to resume from)")
    r.add_argument("--to", required=True, help="destination path (must not exist)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    r.add_argument("--host", metavar="HOST",
                   help="the training host whose disk --to is on, which runs the restore (default: this host); it "
                        "must have a running consumer (`ckpt up` or `dramatiq pipeline.tasks`), else it is refused. "
                        "`ckpt status` lists the hosts")
    r.add_argument("--wait", action="store_true")
    r.add_argument("--timeout", type=float, default=3600.0)
    r.set_defaults(func=cmd_restore)

    sc = sub.add_parser("scrub", help="re-hash every replica on the storage workers, read back the object stores")
    sc.add_argument("--worker", action="append", help="only this worker (repeatable)")
    sc.add_argument("--wait", action="store_true")
    sc.add_argument("--timeout", type=float, default=24 * 3600.0)
    sc.set_defaults(func=cmd_scrub)

    s = sub.add_parser("status", help="cluster health and one line per run; --verbose: every table")
    s.add_argument("--verbose", "-l", dest="detail", action="store_true",
                   help="runs with their checkpoints, capacity, problems, jobs, hosts and workers (what a filter "
                        "or --before shows too)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--all", action="store_true", help="every version of each checkpoint, not only the current one")
    s.add_argument("--run", help="only this run directory")
    s.add_argument("--state", help="only checkpoints in this state (e.g. waiting, failed, forgotten)")
    s.add_argument("--search", help="only checkpoints whose path holds this text (any case)")
    s.add_argument("--limit", type=int, default=50, help="checkpoints per page, newest first (default 50)")
    s.add_argument("--before", type=int, help="the page of checkpoints older than this id")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("dead-letters", help="list or requeue failed messages")
    d.add_argument("--requeue", metavar="ID|all")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_dead_letters)

    web = sub.add_parser("web", help="serve the web UI and JSON API (gunicorn, threaded)")
    web.add_argument("--host", help="address to bind (default 127.0.0.1)")
    web.add_argument("--port", type=int, help="port (default 8080)")
    web.add_argument("--threads", type=int, default=8)
    web.set_defaults(func=cmd_web)

    add_retention_parsers(sub)
    add_workers_parser(sub)
    add_config_parser(sub)
    add_target_parser(sub)

    for name, func, text in (("scheduler", cmd_scheduler, "run the scheduler (leases, probes, rotation)"),
                             ("watch", cmd_watch, "run the watcher on the roots"),
                             ("migrate", cmd_migrate, "upgrade the control plane to the newest schema")):
        c = sub.add_parser(name, help=text)
        if name == "watch":
            c.add_argument("--root", action="append")
        c.set_defaults(func=func)
    for c in sub.choices.values():
        add_home_option(c)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("dramatiq").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except CkptError as exc:
        print(f"ckpt: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `ckpt status | head`
        sys.stderr.close()
        return 0
    finally:
        # The interpreter's last collection walks every object of SQLAlchemy, Alembic and
        # Dramatiq: 0.2 s of a command's exit. Nothing of ours waits on it (files and
        # connections are closed by their context managers), so leave them out of it.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
