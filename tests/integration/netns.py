"""Running a scenario module inside a private network namespace (``unshare -n``).

Servers a scenario starts may bind any loopback address, and ``tc`` may shape its loopback:
nothing reaches the machine's real interfaces. The scenario prints one line
``RESULT <json>``; :func:`run_scenario` returns that document.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def netns_available() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def run_scenario(module: str, tmp: Path, timeout: float = 240) -> dict:
    script = f"ip link set lo up && exec {sys.executable} -m {module} {tmp}"
    r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
