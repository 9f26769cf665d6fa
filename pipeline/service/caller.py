"""What of a warm command's caller its served child must share, and whether it can.

A process forked from ``ckpt up``'s command server (pipeline/service/commands.py) runs the
caller's command exactly as the caller would only when everything a process gets at its start,
and cannot change afterwards, is the same in both. :func:`refusal` compares what
``/proc/<caller>`` shows with this process; :class:`Caller` is what the child then takes over:
the caller's umask, ignored and blocked signals, cgroup. What neither ``/proc`` nor the request
shows (a Landlock domain) is not compared: docs/design.md, "Warm commands".
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.cli.warm import package_dir
from pipeline.priority import of_process

#: Environment read only as a process (or its C library, or its interpreter) starts: the caller's
#: must equal this process's. By prefix, then by name.
AT_START_PREFIXES = ("PYTHON", "LD_", "GLIBC_", "MALLOC_")
#: ... except these, which the child applies itself (its streams; bytecode it never writes).
APPLIED = frozenset({"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONBREAKPOINT"})
AT_START = ("LANG", "LC_ALL", "LC_CTYPE", "CKPT_FAILPOINTS")  # pipeline.failpoints reads it at import
#: Kinds of namespace (absent ones are skipped: an older kernel).
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts", "time")
#: Fields of /proc/<pid>/status that must be equal: credentials, capabilities, sandboxing, where it may run.
STATUS = ("Uid:", "Gid:", "Groups:", "CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "NoNewPrivs:",
          "Seccomp:", "Seccomp_filters:", "Speculation_Store_Bypass:", "SpeculationIndirectBranch:",
          "Cpus_allowed_list:", "Mems_allowed_list:")
#: Files of /proc/<pid> that must be equal: limits, OOM score, the security module's label, the
#: execution domain (setarch), the audit login identity.
FILES = ("limits", "oom_score_adj", "attr/current", "personality", "loginuid")


@dataclass(frozen=True)
class Caller:
    """What the child takes from its caller."""

    pid: int
    umask: int
    ignored: frozenset[int]  # signals the caller ignores (nohup: SIGHUP; `cmd &` in a script: SIGINT)
    blocked: frozenset[int]
    cgroup: str


def refusal(request: dict[str, Any], pid: int, uid: int, changed: str | None) -> str | Caller:
    """Why a child of this process would not run ``request`` as its caller ``pid`` would, or the
    :class:`Caller` it would take over. ``changed``: a file of this process's code that changed."""
    if uid != os.getuid():
        return "another user"
    if not request.get("argv") or not isinstance(request.get("env"), dict):
        return "not a request"
    mine = {"python": sys.executable, "version": sys.version, "flags": list(sys.flags), "package": package_dir(),
            "warnoptions": list(sys.warnoptions), "xoptions": {k: str(v) for k, v in sys._xoptions.items()}}
    for key, value in mine.items():
        if request.get(key) != value:
            return f"another {key}: {request.get(key)!r}"
    env = request["env"]
    names = {n for n in (*env, *os.environ) if n.startswith(AT_START_PREFIXES) and n not in APPLIED}
    for name in sorted(names | set(AT_START)):
        if env.get(name) != os.environ.get(name):
            return f"another {name}"
    if changed is not None:
        return f"the code changed ({changed})"
    try:
        for ns in NAMESPACES:
            try:
                own = os.readlink(f"/proc/self/ns/{ns}")
            except FileNotFoundError:
                continue
            if os.readlink(f"/proc/{pid}/ns/{ns}") != own:
                return f"another {ns} namespace"
        theirs, root = os.stat(f"/proc/{pid}/root"), os.stat("/proc/self/root")
        if (theirs.st_dev, theirs.st_ino) != (root.st_dev, root.st_ino):
            return "another root directory"
        for name in FILES:
            if _read(f"/proc/{pid}/{name}") != _read(f"/proc/self/{name}"):
                return f"other {name}"
        status, own_status = _status(pid), _status("self")
        for field in STATUS:
            if status.get(field) != own_status.get(field):
                return f"another {field.rstrip(':')}"
        if of_process(pid) != of_process(os.getpid()) or _scheduling(pid) != _scheduling("self"):
            return "another priority"
        return Caller(pid, int(status.get("Umask:", "0022"), 8), _signals(status["SigIgn:"]),
                      _signals(status["SigBlk:"]), Path(f"/proc/{pid}/cgroup").read_text())
    except (OSError, ValueError, KeyError) as exc:
        return f"cannot tell ({exc})"


def join_cgroup(pid: int, cgroup: str) -> str | None:
    """Move ``pid`` (a child) into the caller's ``cgroup`` (its /proc/PID/cgroup), so that it
    runs under the caller's limits and accounting; why it could not (None: it is there)."""
    if Path("/proc/self/cgroup").read_text() == cgroup:
        return None
    lines = cgroup.splitlines()
    if len(lines) != 1 or not lines[0].startswith("0::/"):
        return "another cgroup (not cgroup v2)"
    try:
        Path("/sys/fs/cgroup", lines[0][4:].lstrip("/"), "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        return f"another cgroup, which this process may not join ({exc.strerror})"
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:  # attr/current without a security module: EINVAL
        return f"unreadable: {exc.errno}"


def _status(pid: int | str) -> dict[str, str]:
    """``/proc/PID/status`` as ``{"Uid:": "0 0 0 0", ...}``."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[f"{name}:"] = value.strip()
    return fields


def _scheduling(pid: int | str) -> tuple[str, str]:
    """(rt_priority, policy): fields 40 and 41 of /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[37], fields[38]


def _signals(mask: str) -> frozenset[int]:
    """The signals of a /proc/PID/status mask that a process may set (not the C library's own:
    a mask holding them is warned of on stderr, and they cannot be set anyway)."""
    bits = int(mask, 16)
    valid = signal.valid_signals()
    return frozenset(n for n in range(1, 65) if bits >> (n - 1) & 1 and n in valid)
