"""``ckpt target``: add, list and remove the object-store targets of config.toml (``[[targets]]``).

``add`` validates a target with the code that loads the configuration (pipeline/objectstore/
config.py), checks its bucket with the credentials this command finds (pipeline/objectstore/
probe.py) and appends its table to config.toml; ``remove`` cuts that table out. Every other byte
of the file is kept (pipeline/configfile.py). No credential is ever written: the processes that
talk to the store find theirs where every AWS tool does. Settings are read when a process
starts, so a running ``ckpt up`` uses a change after its restart.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import configfile, effective
from pipeline.cli.common import add_home_option, existing_home, explained, parse_size
from pipeline.errors import CkptError, ObjectStoreError
from pipeline.objectstore.config import Target, from_json, parse_targets, parse_url, target_from
from pipeline.units import human_bytes

if TYPE_CHECKING:
    from pipeline.objectstore.client import ObjectStore

KEY = "targets"
#: Where ``Settings.targets`` comes from when it is the environment's (this command's, or the
#: running ``ckpt up``'s), not config.toml's: those targets are not in the file.
FROM_ENV = {"env": "CKPT_TARGETS", "ckpt up (env)": "CKPT_TARGETS of the running `ckpt up`"}


def cmd_target(args: argparse.Namespace) -> int:
    return {"add": cmd_add, "list": cmd_list, "remove": cmd_remove}[args.action or "list"](args)


# -- add --------------------------------------------------------------------------------------


def cmd_add(args: argparse.Namespace) -> int:
    home = existing_home(args)
    s, sources = explained(args)  # the configuration as it is must load: a broken one is named first
    env_targets = s.object_targets() if sources["targets"] in FROM_ENV else []
    options = {"endpoint": args.endpoint, "region": args.region, "profile": args.profile,
               "addressing_style": args.addressing_style, "sse": args.sse, "sse_kms_key_id": args.sse_kms_key_id,
               "quota_bytes": args.quota}
    path = home / configfile.NAME
    with configfile.locked(home):
        text, data = configfile.read(path)
        present = [(t, str(path)) for t in parse_targets(data.get(KEY, []), str(path))]
        present += [(t, FROM_ENV[sources["targets"]]) for t in env_targets]
        name = args.name or _free_name(parse_url(args.url, "ckpt target add")[0], {t.name for t, _ in present})
        table = {"name": name, "url": args.url, **{k: v for k, v in options.items() if v is not None}}
        target = target_from(table, "ckpt target add")
        table["url"] = target.url  # as it is loaded: s3://bucket/prefix, no stray slashes
        for t, where in present:
            if t.name == target.name:
                raise CkptError(f"a target named {t.name!r} is already in {where} ({t.url}); give another --name")
            if (t.url, t.endpoint) == (target.url, target.endpoint):
                raise CkptError(f"{target.url}{' at ' + t.endpoint if t.endpoint else ''} is already target "
                                f"{t.name!r} in {where}")
        checked = ""
        if not args.no_check:
            try:
                checked = _check(target)
            except ObjectStoreError as exc:
                print(f"ckpt: error: {exc}\nnothing was written to {path}", file=sys.stderr)
                return 2
        new = configfile.appended(text, data, KEY, table, path)
        configfile.write(path, new)
    print(f"added target {name} ({target.url}) to {path}:")
    print("".join(f"  {line}\n" for line in configfile.render(KEY, table).splitlines()), end="")
    if args.no_check:
        print("not checked (--no-check): `ckpt target list --check` checks it")
    else:
        whose = f" (profile {target.profile!r})" if target.profile else ""
        print(f"checked with the credentials from {checked}{whose}: the bucket answers, and a probe object was put "
              "with its SHA-256, confirmed by the store's checksum and deleted")
    print("no credential is recorded: each process that talks to the store (those of `ckpt up`) finds its own, "
          "the same way (the environment, the target's profile, or an instance role)")
    for line in _restart_notes(home, sources["targets"]):
        print(line)
    return 0


def _free_name(bucket: str, taken: set[str]) -> str:
    """The bucket's name, or ``<bucket>-2``, ``-3``... when a target has it already."""
    name, n = bucket, 1
    while name in taken:
        n += 1
        name = f"{bucket[:62 - len(str(n))]}-{n}"
    return name


def _store(target: Target) -> ObjectStore:
    try:
        from pipeline.objectstore.client import ObjectStore
    except ImportError as exc:
        raise CkptError(f"talking to an object store needs boto3 ({exc}): pip install 'ckpt-pipeline[s3]'") from exc
    return ObjectStore(target)


def _check(target: Target) -> str:
    """Probe ``target`` (pipeline/objectstore/probe.py); where the credentials came from."""
    from pipeline.objectstore.probe import probe

    return probe(_store(target)).credentials


def _restart_notes(home: Path, source: str) -> list[str]:
    """What a change of config.toml's targets does to the running ``ckpt up`` and this shell."""
    notes = []
    record = effective.read(home)
    if record is not None and not record.ignored:
        notes.append(f"the running `ckpt up` (pid {record.pid}) read its settings when it started: it uses this "
                     "change once restarted (commands run from now on use it at once)")
    else:
        notes.append("`ckpt up` uses it from its next start")
    if source in FROM_ENV:
        notes.append(f"but {FROM_ENV[source]} is set: it replaces config.toml's [[targets]] wherever it is set; "
                     "unset it to use config.toml's")
    return notes


# -- list -------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    home = existing_home(args)
    s, sources = explained(args)
    path = home / configfile.NAME
    _, data = configfile.read(path)
    rows = [(t, "config.toml") for t in parse_targets(data.get(KEY, []), str(path))]
    if sources["targets"] in FROM_ENV:
        rows += [(t, FROM_ENV[sources["targets"]]) for t in s.object_targets()]
    out = [_row(t, where, check=args.check) for t, where in rows]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_rows(out)
        for line in _running_differs(home, [t for t, where in rows if where == "config.toml"], sources["targets"]):
            print(line)
    return 2 if args.check and any(not r["answers"] for r in out) else 0


def _row(t: Target, where: str, *, check: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"name": t.name, "url": t.url, "source": where, "endpoint": t.endpoint,
                           "region": t.region, "profile": t.profile, "addressing_style": t.addressing_style,
                           "sse": t.sse, "sse_kms_key_id": t.sse_kms_key_id, "quota_bytes": t.quota_bytes}
    try:
        store = _store(t)
    except CkptError as exc:
        row["credentials"] = str(exc)
        return row | ({"answers": False, "error": str(exc), "used_bytes": None} if check else {})
    source = store.credentials_source()
    row["credentials"] = (source + (f" (profile {t.profile!r})" if t.profile else "")) if source \
        else store.credentials_hint()
    if check:
        from pipeline.objectstore.probe import probe

        try:
            probe(store, write=False)
            row |= {"answers": True, "error": None, "used_bytes": store.used_bytes()}
        except ObjectStoreError as exc:
            row |= {"answers": False, "error": str(exc), "used_bytes": None}
    return row


def _print_rows(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no object-store targets (`ckpt target add s3://bucket/prefix [--endpoint URL] [--profile P]` adds one)")
    for r in rows:
        print(f"{r['name']}  {r['url']}  ({r['source']})")
        endpoint = r["endpoint"] or "AWS S3"
        print(f"  endpoint     {endpoint}" + (f" ({r['addressing_style']} addressing)"
                                              if r["addressing_style"] != "auto" else ""))
        print(f"  region       {r['region'] or 'from the profile or the environment'}")
        print(f"  credentials  {r['credentials']}")
        if r["sse"]:
            print(f"  encryption   {r['sse']}" + (f" (key {r['sse_kms_key_id']})" if r["sse_kms_key_id"] else ""))
        quota = r["quota_bytes"]
        print(f"  quota        {human_bytes(quota) if quota else 'none'}")
        if "answers" in r:
            if not r["answers"]:
                print(f"  now          does not answer: {r['error']}")
            else:
                used = r["used_bytes"]
                share = f" of {human_bytes(quota)} ({100 * used / quota:.1f} %)" if quota else ""
                print(f"  now          answers; {human_bytes(used)} used{share}")


def _running_differs(home: Path, configured: list[Target], source: str) -> list[str]:
    """A note when the running ``ckpt up`` uses other targets than config.toml now has."""
    record = effective.read(home)
    if record is None or record.ignored or source in FROM_ENV:
        return []
    running = from_json(str(record.values.get(KEY, "")), f"{record.path}: targets")
    if running == configured:
        return []
    names = ", ".join(t.name for t in running) or "none"
    return [f"the running `ckpt up` (pid {record.pid}) uses the targets config.toml had when it started ({names}): "
            "restart it to use these"]


# -- remove -----------------------------------------------------------------------------------


def cmd_remove(args: argparse.Namespace) -> int:
    home = existing_home(args)
    path = home / configfile.NAME
    with configfile.locked(home):
        text, data = configfile.read(path)
        tables = data.get(KEY, [])
        index = next((i for i, t in enumerate(tables) if isinstance(t, dict) and t.get("name") == args.name), None) \
            if isinstance(tables, list) else None
        if index is None:
            raise _unknown(args, path, tables)
        url = tables[index].get("url", "")
        try:
            settings, _sources = explained(args)
        except CkptError:
            settings = None  # a table the loader refuses (one holding a key) never ran: removed as it is
        if settings is not None:
            from pipeline import operations  # SQLAlchemy: only to remove

            operations.check_target_removal(settings, args.name)
        configfile.write(path, configfile.removed(text, data, KEY, index, path))
    print(f"removed target {args.name} ({url}) from {path}")
    print("the copies already in the bucket are not deleted: the bucket keeps them until you delete them there; "
          "once restarted, `ckpt up` marks the target down and its copies stop counting")
    record = effective.read(home)
    if record is not None and not record.ignored:
        print(f"the running `ckpt up` (pid {record.pid}) read its settings when it started: it uses this target "
              "until it is restarted")
    return 0


def _unknown(args: argparse.Namespace, path: Path, tables: Any) -> CkptError:
    """The error for a name that is not in config.toml: one of CKPT_TARGETS, or none at all."""
    try:
        s, sources = explained(args)
        if sources["targets"] in FROM_ENV and any(t.name == args.name for t in s.object_targets()):
            return CkptError(f"target {args.name!r} is defined in {FROM_ENV[sources['targets']]}, not in {path}: "
                             "`ckpt target remove` edits only config.toml; change that environment variable")
    except CkptError:
        pass  # the configuration does not load: the name is still not in config.toml
    names = [t.get("name") for t in tables if isinstance(t, dict)] if isinstance(tables, list) else []
    known = f"its targets: {', '.join(map(str, names))}" if names else "it has none"
    return CkptError(f"no target named {args.name!r} in {path} ({known}; `ckpt target list` shows them all)")


# -- parser -----------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser("target", help="the object-store targets (S3-compatible buckets): add, list, remove",
                       description="ckpt target add s3://bucket/prefix [options] | list [--check] [--json] | "
                                   "remove NAME")
    p.set_defaults(func=cmd_target, action=None, check=False, json=False)
    actions = p.add_subparsers(dest="action")

    a = actions.add_parser("add", help="check a bucket, then add it to config.toml as a [[targets]] table")
    a.add_argument("url", metavar="s3://bucket/prefix")
    a.add_argument("--name", help="the target's name (default: the bucket's, made unique)")
    a.add_argument("--endpoint", help="http(s)://host[:port] of an S3-compatible store (default: AWS S3)")
    a.add_argument("--region", help="default: the profile's or the environment's")
    a.add_argument("--profile", help="a profile of ~/.aws/credentials or ~/.aws/config (default: the environment "
                                     "or the instance role); credentials are never given here")
    a.add_argument("--addressing-style", help="auto (default), path (most self-hosted stores) or virtual")
    a.add_argument("--sse", help="server-side encryption: AES256 or aws:kms")
    a.add_argument("--sse-kms-key-id", help="with --sse aws:kms: the key (default: the bucket's)")
    a.add_argument("--quota", type=parse_size, help="most bytes ckpt may keep there, e.g. 500GB (default: none)")
    a.add_argument("--no-check", action="store_true",
                   help="add it without checking that the bucket answers and takes a probe object")
    l_ = actions.add_parser("list", help="every target: url, endpoint, region, where its credentials come from, quota")
    l_.add_argument("--check", action="store_true", help="also whether each answers now, and the bytes it holds")
    l_.add_argument("--json", action="store_true")
    r = actions.add_parser("remove", help="remove a target's table from config.toml (its copies stay in the bucket)")
    r.add_argument("name")
    for c in (a, l_, r):  # `ckpt target --home` is main's
        add_home_option(c)
