"""A served command's stderr is the caller's: the command server's signal masks never warn there.

``range(1, NSIG)`` holds the C library's own two signals (32, 33); ``pthread_sigmask`` warns of
each (RuntimeWarning), once per process until a command resets the warning filters (boto3's
import does). A served restore from an object store ended with two such warnings on the user's
terminal (found by a full run: the test read them in the restore's output).
"""
from __future__ import annotations

import subprocess
import sys

from pipeline.service.caller import _signals


def test_ending_a_served_command_blocks_every_signal_without_a_warning():
    code = ("import socket, warnings\n"
            "warnings.simplefilter('error')\n"  # a warning is an exception here
            "from pipeline.service import served\n"
            "a, b = socket.socketpair()\n"
            "served._say(a, {'exit': 0})\n"
            "print(b.recv(64).decode())\n"
            "a.close(); b.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, '{"exit": 0}', "")


def test_a_callers_blocked_signals_are_only_those_a_process_can_block():
    # SIGINT (2), SIGTERM (15), the C library's 32 and 33, and SIGRTMIN+2 (36)
    mask = f"{sum(1 << (n - 1) for n in (2, 15, 32, 33, 36)):016x}"
    assert _signals(mask) == {2, 15, 36}
