"""What the fork server's tests run as a child: ``python -m tests.unit.forked_child WHAT [ARGS]``."""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

POOLS: list[ThreadPoolExecutor] = []


def main(what: str, args: list[str]) -> None:
    if what == "exit":
        sys.exit(int(args[0]))
    if what == "message":
        sys.exit("the child's own message")
    if what == "raise":
        raise RuntimeError("boom")
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "sleep":
        print("sleeping", flush=True)
        time.sleep(float(args[0]))
    if what == "show":
        print(json.dumps({"cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv, "path": sys.path,
                          "stdin": sys.stdin.read(), "unbuffered": sys.stdout.write_through,
                          "fds": sorted(os.listdir("/proc/self/fd"))}))
    if what == "echo":
        data = sys.stdin.read()
        print(f"out {data}")
        print(f"err {data}", file=sys.stderr)
    if what == "exit-late":  # what the interpreter waits for at exit
        atexit.register(lambda: print("atexit", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        POOLS.append(ThreadPoolExecutor(1))  # held to the end, as a trainer's: threading's exit hook ends it
        POOLS[0].submit(lambda: (time.sleep(0.6), print("pool done", flush=True)))
        print("main done", flush=True)
    if what == "slow-save":  # with CKPT_SLOW_ROOT: seconds to save a tensor as save_pretrained does
        import torch
        from transformers import modeling_utils

        import tests.writers.slow  # noqa: F401  (after transformers, as in a forked writer)

        started = time.monotonic()
        modeling_utils.safe_save_file({"w": torch.zeros(4)}, os.path.join(args[0], "w.safetensors"))
        print(time.monotonic() - started, torch.serialization.save.__name__)
    if what == "numpy":
        import numpy

        a = numpy.ones((300, 300))
        print(float((a @ a).sum()), numpy.random.random())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
