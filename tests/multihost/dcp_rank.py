"""One rank of a torch DCP save across hosts: ``python -m tests.multihost.dcp_rank RANK WORLD
MASTER_ADDR PORT OUT STEP [SEED]``. Every rank writes its own tensors (``rank<r>.*``) to OUT on
its own disk; rank 0, the coordinator, writes ``.metadata`` there last. SEED (default 0) gives the
same step other tensors: the step saved again after a restart."""
from __future__ import annotations

import os
import sys


def state(rank: int, step: int, seed: int = 0) -> dict:
    import torch

    torch.manual_seed(1000 * step + rank + 1_000_000 * seed)
    return {f"rank{rank}.layer{i}.weight": torch.randn(96, 128) for i in range(3)}


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world, addr, port, out, step = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4], int(argv[5])
    seed = int(argv[6]) if len(argv) > 6 else 0
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dcp.save(state(rank, step, seed), checkpoint_id=out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
