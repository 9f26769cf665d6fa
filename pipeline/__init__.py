"""ckpt-pipeline: protects training checkpoints (see README.md and docs/design.md).

Importing this package starts nothing. ``load_state_dict`` is the public Python API.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pipeline.settings import Settings


def load_state_dict(checkpoint: str | int, settings: Settings | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a protected checkpoint (id or path), built from its shards."""
    from pipeline.restore.loader import load_state_dict as _load

    return _load(checkpoint, settings)


__all__ = ["load_state_dict"]
