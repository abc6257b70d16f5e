"""What a step costs in memory: peak device memory, and the largest value over ranks.

FLOPs and MFU come from the one cost model, ``estimate/cost.py``, so ``plan`` and ``train`` agree.
"""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gib() -> float:
    """Peak allocated device memory on GPU; peak resident set size of this process on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def max_over_ranks(value: float) -> float:
    """The largest value across all ranks (the one that limits a job), as a float on every rank."""
    if not torch.distributed.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())
