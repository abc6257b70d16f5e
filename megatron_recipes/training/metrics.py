"""What a step costs in memory (peak device memory, the largest value over ranks) and the metrics a log line
averages over the steps since the last one.

FLOPs and MFU come from the one cost model, ``estimate/cost.py``, so ``plan`` and ``train`` agree.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import Dict, List

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


@dataclass
class Window:
    """Metrics accumulated between two log lines."""

    losses: List[float] = field(default_factory=list)
    mtp_losses: List[List[float]] = field(default_factory=list)  # per step: one per MTP layer
    seconds: float = 0.0
    skipped: int = 0

    def add(self, result, seconds: float) -> None:  # a step.StepResult
        self.losses.append(result.loss)
        if result.mtp_losses is not None:
            self.mtp_losses.append(result.mtp_losses)
        self.seconds += seconds
        self.skipped += int(result.skipped)

    def mtp_metrics(self) -> Dict[str, float]:
        """``mtp_<k>_loss``: MTP layer k's loss averaged over the window, as the main loss is (Megatron-LM's
        ``mtp_<k> loss``)."""
        if not self.mtp_losses:
            return {}
        return {f"mtp_{k + 1}_loss": sum(step_[k] for step_ in self.mtp_losses) / len(self.mtp_losses)
                for k in range(len(self.mtp_losses[0]))}
