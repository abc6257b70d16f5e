"""What a checkpoint save costs the host: the fully_reshardable optimizer gather, counted before a run.

Why: ``fully_reshardable`` (megatron-core's DistributedOptimizer, memory-efficient variant) gathers every
data-parallel rank's optimizer shard to DP rank 0 of its model-parallel group over gloo, into host memory,
on every save. Its size is the optimizer state of one model-parallel rank: the fp32 parameter (the main
copy, or the parameter itself in fp32) plus the optimizer's moments, for the fullest pipeline stage's
parameters on that rank. At 405B-671B that is tens of GB per DP-rank-0 process and minutes over TCP,
close to the 10-minute collective timeout. ``dp_reshardable`` saves the flat shards where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate.params import stage_params

GB = 1e9
GLOO_GATHER_BYTES_PER_S = 1.0e9  # host-to-host over gloo/TCP into one receiver (assumed, conservative)
LARGE_GATHER_BYTES = 16 * GB  # per DP-rank-0 process; eight of them can share one node's RAM
LARGE_GATHER_SECONDS = 120.0  # a fifth of the 10-minute collective timeout
COLLECTIVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class GatherCost:
    host_bytes: float  # host memory on DP rank 0 of the fullest model-parallel group, per save
    seconds: float  # the gather's time at GLOO_GATHER_BYTES_PER_S

    @property
    def large(self) -> bool:
        return self.host_bytes >= LARGE_GATHER_BYTES or self.seconds >= LARGE_GATHER_SECONDS


def state_bytes_per_param(cfg: RunConfig) -> float:
    """fp32 parameter + moments: what megatron-core stores per parameter in the optimizer's param state."""
    o = cfg.optimizer
    if o.name == "sgd":
        return 4 + (4 if o.sgd_momentum > 0 else 0)
    return 12


def optimizer_gather(cfg: RunConfig) -> GatherCost:
    """The fully_reshardable gather of one save; zero without a distributed optimizer (nothing is gathered)
    or with PEFT (the frozen base has no optimizer state; adapters are small)."""
    if not cfg.optimizer.use_distributed_optimizer or cfg.parallel.fsdp or cfg.peft.method != "none":
        return GatherCost(0.0, 0.0)
    params = max(stage_params(cfg, r).total for r in range(max(1, cfg.parallel.pp)))
    host = params * state_bytes_per_param(cfg)
    dp = max(1, derived.data_parallel_size(cfg))
    return GatherCost(host, host * (dp - 1) / dp / GLOO_GATHER_BYTES_PER_S)
