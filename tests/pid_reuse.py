"""A ``ckpt up`` record left by a killed process, and a later process with the same pid.

Run inside a private pid namespace (``unshare --pid --fork --mount-proc``), where pids are
ours to hand out: ``python -m tests.pid_reuse ROLE HOME``.

- ``writer``: records what ``ckpt up`` records (``effective.toml`` with rf 3 from its env,
  ``up.json``), says ``written`` and sleeps until it is killed.
- ``reader``: loads the settings of the home twice, as a later command in another shell does,
  and prints ``RESULT <json>``: its pid, rf and its source, why the record is not applied, and
  what the trainer integration says of the ``ckpt up`` in ``up.json``.
- ``wrap``: as pid 1 of the namespace, starts the writer as pid 300, SIGKILLs it, then starts
  the reader as pid 300 too (the pid counter wrapped around) and prints the reader's result.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PID = 300


def writer(home: Path) -> None:
    from pipeline import effective, liveness
    from pipeline.durable import write_private
    from pipeline.settings import load

    s = load({"home": home}, environ={"CKPT_RF": "3"}, recorded=False)
    effective.write(s, {"rf": "env"})
    write_private(home / "up.json", json.dumps({**liveness.stamp(), "home": str(home)}))
    print("written", flush=True)
    time.sleep(120)


def reader(home: Path) -> None:
    from pipeline import effective
    from pipeline.integrations.protection import up_gone
    from pipeline.settings import explain

    explain({"home": home}, environ={})
    s, sources = explain({"home": home}, environ={})
    record = effective.read(home)
    print("RESULT " + json.dumps({"pid": os.getpid(), "rf": s.rf, "source": sources["rf"],
                                  "ignored": record.ignored if record else None, "up_gone": up_gone(s)}), flush=True)


def _next_pid(pid: int) -> None:
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))


def wrap(home: Path) -> None:
    assert os.getpid() == 1, "run inside unshare --pid --fork --mount-proc"
    me = [sys.executable, "-m", "tests.pid_reuse"]
    _next_pid(PID)
    w = subprocess.Popen([*me, "writer", str(home)], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None and w.stdout.readline().strip() == "written"
        assert w.pid == PID, w.pid
    finally:
        w.send_signal(signal.SIGKILL)
        w.wait()
    _next_pid(PID)
    r = subprocess.run([*me, "reader", str(home)], stdout=subprocess.PIPE, text=True, timeout=60)
    sys.stdout.write(r.stdout)
    sys.exit(r.returncode)


if __name__ == "__main__":
    {"writer": writer, "reader": reader, "wrap": wrap}[sys.argv[1]](Path(sys.argv[2]))
