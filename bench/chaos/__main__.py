"""``python -m bench.chaos --minutes N [--seed S] [--small]``: run the chaos soak, print its
table, exit 1 if any check failed."""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from bench.chaos.soak import Config, Soak, save_doc, small


def main(argv: list[str] | None = None) -> int:
    from bench.cluster import missing

    ap = argparse.ArgumentParser(prog="./dev chaos")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=None, help="the fault schedule's seed (default: drawn, printed)")
    ap.add_argument("--small", action="store_true", help="the test suite's sizes: a few MB per save, short faults")
    ap.add_argument("--root", type=Path, default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, disks' images removed)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here as JSON")
    a = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"chaos soak: cannot build the box here: {why}", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else random.randrange(1 << 16)
    config = small(a.minutes, seed) if a.small else Config(minutes=a.minutes, seed=seed)
    config.root, config.keep = a.root, a.keep
    result = Soak(config).run()
    print(result.report)
    if a.json:
        save_doc(result.doc, a.json)
    print(f"(seed {seed}: `./dev chaos --minutes {a.minutes:g} --seed {seed}{' --small' if a.small else ''}` "
          "draws the same schedule)")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
