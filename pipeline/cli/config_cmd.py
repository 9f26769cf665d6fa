"""``ckpt config``: each effective setting, and where it came from."""
from __future__ import annotations

import argparse
import dataclasses
import json

from pipeline import effective
from pipeline.cli.common import explained
from pipeline.settings import Settings


def shown(s: Settings, name: str) -> object:
    """The value of setting ``name`` as ``ckpt config`` shows it: secrets masked."""
    value = getattr(s, name)
    hidden = effective.secret_form(name, value)
    if hidden is not None:
        return hidden
    if name == "cluster_key":
        return ""
    return str(value) if name == "home" else value


def cmd_config(args: argparse.Namespace) -> int:
    s, sources = explained(args)
    names = [f.name for f in dataclasses.fields(s) if f.name != "ready_dir"]
    if args.json:
        print(json.dumps([{"name": n, "value": shown(s, n), "source": sources[n]} for n in names], indent=2))
        return 0
    width = max(len(n) for n in names)
    for n in names:
        print(f"{n:<{width}} = {effective.toml_value(shown(s, n))}  # {sources[n]}")
    record = effective.read(s.home)
    if record is None:
        print(f"# no `ckpt up` runs for home {s.home}: its settings would be these, over its own flags and env")
    elif record.ignored:
        print(f"# {record.path} is not applied: {record.ignored}")
    else:
        print(f"# `ckpt up` (pid {record.pid}) runs with the settings in {record.path}; a command's own CKPT_* "
              "env and flags come before them")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="each effective setting and where it came from "
                                      "(default, config.toml, ckpt up, env, flag)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_config)
