"""Sizes as people read them: the one formatter of byte counts for the CLI and messages."""
from __future__ import annotations


def human_bytes(n: int | float) -> str:
    """``n`` bytes in decimal units with one decimal: ``201.3 MB``, ``1.1 TB``, ``512 bytes``."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} byte" + ("" if int(n) == 1 else "s")
