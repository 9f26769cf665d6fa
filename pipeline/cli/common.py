"""What every ``ckpt`` command shares: settings from the flags, the control plane, signals."""
from __future__ import annotations

import argparse
import gc
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from pipeline import home
from pipeline import settings as settings_mod
from pipeline.errors import CkptError
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.steps import Send


def settings_from(args: argparse.Namespace, *, create: bool = False, **flags: Any) -> Settings:
    """The settings of the home this command runs against (pipeline/home.py: ``--home``,
    ``CKPT_HOME``, the nearest ``.ckpt`` upward, this user's default). Only a command that
    sets a machine up or runs a service (``create``) may start a new home; the others say
    where they looked (unless the control plane is elsewhere: ``CKPT_DATABASE_URL``)."""
    return explained(args, create=create, **flags)[0]


def explained(args: argparse.Namespace, *, create: bool = False, recorded: bool = True,
              **flags: Any) -> tuple[Settings, dict[str, str]]:
    """:func:`settings_from`, with where each value came from (pipeline.settings.explain)."""
    found = home.find(getattr(args, "home", None), os.environ)
    if not create and not found.exists and not os.environ.get("CKPT_DATABASE_URL"):
        raise CkptError(found.missing())
    overrides: dict[str, Any] = {"home": str(found.path), **flags}
    roots = getattr(args, "root", None)
    if roots:
        overrides["roots"] = tuple(roots)
    s, sources = settings_mod.explain(overrides, recorded=recorded)
    sources["home"] = found.source  # --home is passed on as a flag whichever way the home was found
    return settings_mod.configure(s), sources


def existing_home(args: argparse.Namespace) -> Path:
    """The home this command edits (pipeline/home.py), which must exist already."""
    found = home.find(getattr(args, "home", None), os.environ)
    if not found.exists:
        raise CkptError(found.missing())
    return found.path


def add_home_option(parser: argparse.ArgumentParser) -> None:
    """``--home`` on a subcommand too (``ckpt status --home DIR``), without hiding one given
    before it (``ckpt --home DIR status``)."""
    parser.add_argument("--home", default=argparse.SUPPRESS, help=HOME_HELP)


HOME_HELP = ("the ckpt home (state directory). Default: CKPT_HOME, else the nearest .ckpt in this directory or "
             "its parents, else ~/.local/share/ckpt; `ckpt up` starts ./.ckpt when there is none")


def send(sends: list[Send]) -> None:
    from pipeline.tasks.actors import send_all

    send_all(sends)


def control_plane(s: Settings) -> None:
    """Bring the control plane to the newest schema, install the broker and declare the actors."""
    from pipeline.db.migrate import upgrade

    upgrade(s.db_url)
    import pipeline.tasks  # noqa: F401


@contextmanager
def collection_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: for a command that ends in a fraction of a second.

    What such a command allocates is mostly the modules it imports (SQLAlchemy, the models),
    which live as long as the process: the collector, run every few hundred allocations, walks
    them again and again and frees nothing (about 30 ms of each ``ckpt status``'s CPU). At the
    end what the block allocated is frozen (``gc.freeze``, as :func:`pipeline.cli.main.main`
    does at every command's end), else the first allocation after it would walk all of it at
    once (20 ms). Memory no longer referenced is freed at once all along (reference counting);
    only cycles made inside are kept. Collection is on again after it (a test calling a command
    goes on collecting what it allocates next).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def stop_on_signals(stop: Callable[[], object]) -> None:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``500M``, ``2GiB``, ``1.5T``, ``1048576`` (decimal units, binary with i)."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; try 500M, 2GiB or 1T")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
