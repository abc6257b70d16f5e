"""A launch smoke test: every rank joins one process group and all-reduces; rank 0 prints who joined.

``megatron-recipes slurm submit <recipe> --probe`` runs this instead of training, through the same
script, srun line and rendezvous, in seconds: a cheap check of a new cluster, image or mount set
before a long job queues. NCCL on GPUs, gloo otherwise.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta


def main() -> int:
    import torch
    import torch.distributed as dist

    from megatron_recipes.runtime import collectives

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    total = collectives.all_reduce_values([float(rank + 1)])[0]  # on the GPU under NCCL, as training's are
    members = collectives.all_gather_object({"rank": rank, "node": node, "local_rank": os.environ.get("LOCAL_RANK")})
    expected = world * (world + 1) / 2
    ok = abs(total - expected) < 1e-6
    print(f"[probe] rank {rank}/{world} on {node}: all_reduce sum={total:.0f} (expected {expected:.0f})",
          flush=True)
    if rank == 0:
        nodes = sorted({m["node"] for m in members})
        print(f"[probe] {'ok' if ok else 'FAILED'}: world={world} ranks on {len(nodes)} node(s) {nodes}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
