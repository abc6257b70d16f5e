"""What a step costs in memory: peak device memory, and the largest value over ranks.

FLOPs and MFU come from the one cost model, ``estimate/cost.py``, so ``plan`` and ``train`` agree.
"""

from __future__ import annotations

import resource
import sys

import torch

from megatron_recipes.runtime import collectives


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
    return float(collectives.all_reduce_values([float(value)], op="max")[0])
