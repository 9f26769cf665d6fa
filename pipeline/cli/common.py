"""What every ``ckpt`` command shares: settings from the flags, the control plane, signals."""
from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from pipeline import settings as settings_mod
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.steps import Send


def settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {"home": getattr(args, "home", None)}
    roots = getattr(args, "root", None)
    if roots:
        overrides["roots"] = tuple(roots)
    return settings_mod.configure(settings_mod.load(overrides))


def send(sends: list[Send]) -> None:
    from pipeline.tasks.actors import send_all

    send_all(sends)


def control_plane(s: Settings) -> None:
    """Bring the control plane to the newest schema, install the broker and declare the actors."""
    from pipeline.db.migrate import upgrade

    upgrade(s.db_url)
    import pipeline.tasks  # noqa: F401


def stop_on_signals(stop: Callable[[], object]) -> None:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
