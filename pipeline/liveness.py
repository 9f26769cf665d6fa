"""Whether the process a file names is still the one that wrote it.

``ckpt up`` names itself in ``<home>/up.json`` and ``<home>/effective.toml``. A pid alone does
not say it still runs: after a ``kill -9`` the pid is free, and a later process can get it (pid
wrap-around; every container's first process is pid 1), and then a stale record would look
alive. So a writer records its pid with :func:`identity`: this boot of the machine (the kernel's
``boot_id``), the pid namespace its pid is a number in, and the time the process started
(``/proc/<pid>/stat``, field 22, in clock ticks since boot). The same pid with another start
time is another process. Where ``/proc`` cannot tell (not Linux), the identity is empty and only
the pid is looked at, as it is for a record written before identities were.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_PROC = Path("/proc")


def stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name, so that ``[0]`` is field 3
    (the state) and ``[n - 3]`` field n; OSError when there is no such process."""
    stat = (_PROC / str(pid) / "stat").read_text()
    # Field 2, the command name, is in parentheses and may hold spaces and ")": count after the last one.
    return stat[stat.rindex(")") + 2:].split()


def identity(pid: int | None = None) -> str:
    """``"<boot id> <pid namespace> <start time>"`` of ``pid`` as this process sees it (this
    process when None), or "" when there is no such process or ``/proc`` cannot tell."""
    try:
        boot = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        # The namespace the pid is a number in: this process's (a pid means what it means here).
        space = os.readlink(_PROC / "self/ns/pid")
        fields = stat_fields("self" if pid is None else pid)
    except OSError:
        return ""
    return f"{boot} {space} {fields[19]}"


def stamp() -> dict[str, Any]:
    """What a writer records to be told apart later: its pid and its :func:`identity`."""
    return {"pid": os.getpid(), "process": identity()}


def gone(pid: int, recorded: str) -> str | None:
    """Why the process ``pid`` that recorded ``recorded`` (its :func:`identity`, or "" when the
    record has none) is not running any more, for a message ("is gone (pid 7 is now another
    process)"); None while it still runs."""
    here = identity()
    if not (recorded and here):  # nothing to compare: the pid is all there is
        return None if pid_alive(pid) else "is gone"
    boot, space, _ = (recorded.split(" ") + ["", ""])[:3]
    if boot != here.split(" ")[0]:
        return "is gone (the machine restarted since)"
    if space != here.split(" ")[1]:
        return "ran in another pid namespace (another container), where its pid means another process"
    now = identity(pid)
    if not now:
        return "is gone"
    return None if now == recorded else f"is gone (pid {pid} is now another process)"


def pid_alive(pid: int) -> bool:
    """Whether some process has pid ``pid`` here (any process: see :func:`gone`)."""
    if pid <= 0:  # 0 and -1 would ask about a whole process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True
