"""Where the ckpt home is, found the way git finds its repository (docs/design.md, "The home").

In order: ``--home``, then ``CKPT_HOME``, then the nearest ``.ckpt`` directory in the current
directory or one of its parents, then this user's default (``$XDG_DATA_HOME/ckpt``, else
``~/.local/share/ckpt``), if it exists. Nothing found: ``./.ckpt``, which only ``ckpt up``
(and the commands that set up a machine) may create; a command that only reads or asks says
where it looked instead of creating an empty home.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

NAME = ".ckpt"


@dataclass(frozen=True)
class Home:
    path: Path
    #: how it was found: "flag", "env", "found" (a .ckpt upward), "user", or "new" (nothing found)
    how: str
    looked: tuple[str, ...] = field(default=())

    @property
    def exists(self) -> bool:
        return self.path.is_dir()

    @property
    def source(self) -> str:
        """How it was found, as ``ckpt config`` says it."""
        return {"flag": "flag", "env": "env", "found": "the nearest .ckpt upward",
                "user": "this user's default"}.get(self.how, "new")

    def missing(self) -> str:
        """What to say when a command needs an existing home and there is none."""
        if self.how in ("flag", "env"):
            where = "--home" if self.how == "flag" else "CKPT_HOME"
            return (f"no ckpt home at {self.path} ({where}); start one there with `ckpt up --home {self.path}`"
                    " or point at an existing one")
        return ("no ckpt home found: looked for " + "; ".join(self.looked) + ". Run this where `ckpt up` runs"
                " (or below it), pass --home DIR or set CKPT_HOME")


def user_default(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "ckpt"


def find(flag: str | os.PathLike[str] | None, environ: Mapping[str, str], cwd: Path | None = None) -> Home:
    if flag:
        return Home(Path(flag).expanduser().absolute(), "flag")
    if environ.get("CKPT_HOME"):
        return Home(Path(environ["CKPT_HOME"]).expanduser().absolute(), "env")
    here = (cwd or Path.cwd()).absolute()
    for d in (here, *here.parents):
        if (d / NAME).is_dir():
            return Home(d / NAME, "found")
    user = user_default(environ)
    looked = (f"{NAME} in {here} and its parents", f"this user's default {user}")
    if user.is_dir():
        return Home(user, "user", looked)
    return Home(here / NAME, "new", ("CKPT_HOME (not set)", *looked))
