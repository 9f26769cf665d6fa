"""Loading tensors, timed in a fresh process from a cold page cache.

``python -m bench.loading state_dict CHECKPOINT_ID`` or ``file PATH [--lazy]`` imports
everything first, then times only the load and prints the seconds. A fresh process for
each measurement: one that had freed memory before hands it out again without page
faults, which made whichever load ran second look several times faster.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench import limits


def measure(what: str, arg: str, env: dict[str, str], cold: list[Path], *extra: str) -> float:
    """Seconds of one load in a new process, after dropping ``cold`` from the page cache."""
    for p in cold:
        limits.drop_cache(p)
    out = subprocess.run([sys.executable, "-m", "bench.loading", what, arg, *extra], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def best_of(n: int, *args, **kw) -> float:
    return min(measure(*args, **kw) for _ in range(n))


def main(argv: list[str]) -> None:
    what, arg, *rest = argv
    if what == "state_dict":
        from pipeline.restoring.loader import load_state_dict

        t = time.perf_counter()
        tensors = load_state_dict(int(arg))
    else:
        from safetensors.torch import load_file

        t = time.perf_counter()
        tensors = load_file(arg)
        if "--lazy" not in rest:
            # load_file maps the file and hands out lazy tensors; load_state_dict hands
            # out tensors in memory: bring these into memory too.
            tensors = {k: v.clone() for k, v in tensors.items()}
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "tensors": len(tensors)}))


if __name__ == "__main__":
    main(sys.argv[1:])
