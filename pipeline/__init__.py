"""ckpt-pipeline: protects training checkpoints (see README.md and docs/design.md).

Importing this package starts nothing. The public Python API:

- :func:`protect` declares a checkpoint complete (a trainer's save hook): recorded in the
  background, never raising into training;
- :func:`latest` is the newest protected checkpoint of a run (what to resume from);
- :func:`restore` gives a checkpoint back byte for byte;
- :func:`load_state_dict` builds its tensors straight from the shards (needs torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import torch

    from pipeline.api import Protected
    from pipeline.protector import Declared
    from pipeline.settings import Settings


def protect(path: str | Path, *, settings: Settings | None = None) -> Declared:
    """Declare the checkpoint at ``path`` complete: recorded and stored in the background;
    returns at once and never raises (``.result()`` waits for the record)."""
    from pipeline.api import protect as _protect

    return _protect(path, settings=settings)


def wait_protected(checkpoint: str | int | Path, *, timeout: float = 3600.0,
                   settings: Settings | None = None) -> Protected:
    """Wait until a checkpoint is protected (RF verified copies)."""
    from pipeline.api import wait_protected as _wait

    return _wait(checkpoint, timeout=timeout, settings=settings)


def latest(run: str | Path, *, settings: Settings | None = None) -> Protected | None:
    """The newest protected checkpoint of ``run``, or None."""
    from pipeline.api import latest as _latest

    return _latest(run, settings=settings)


def restore(checkpoint: Any, to: str | Path, *, overwrite: bool = False, wait: bool = True,
            timeout: float = 3600.0, settings: Settings | None = None) -> Path:
    """Give a checkpoint (id, path, or what :func:`latest` returned) back at ``to``."""
    from pipeline.api import restore as _restore

    return _restore(checkpoint, to, overwrite=overwrite, wait=wait, timeout=timeout, settings=settings)


def load_state_dict(checkpoint: str | int, settings: Settings | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a protected checkpoint (id or path), built from its shards (needs torch)."""
    try:
        from pipeline.restoring.loader import load_state_dict as _load
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        from pipeline.errors import CkptError

        raise CkptError("load_state_dict builds torch tensors and needs torch: pip install 'ckpt-pipeline[torch]' "
                        "(or restore the checkpoint as files with `ckpt restore`)") from None
    return _load(checkpoint, settings)


__all__ = ["latest", "load_state_dict", "protect", "restore", "wait_protected"]
