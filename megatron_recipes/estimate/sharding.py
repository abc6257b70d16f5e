"""Model-state bytes per rank under ZeRO-style sharding and optimizer offload, and host memory per node.

Why a module of its own: how weights, gradients and optimizer state divide is one question
(``memory.py`` asks it through ``device_state`` and ``gather_transient``), and offload adds a second
budget, the node's RAM, that the GPU estimate does not see.

Per parameter of this rank (after TP/PP/EP), before sharding, with bf16 params and fp32 grads:
weights 2 B, gradients 4 B, optimizer 12 B (fp32 master + Adam m + v). The shard group is DP x CP for
dense parameters and expert-DP for routed experts, each divided by ``parallel.dist_optimizer_instances``
(hybrid sharding: shard inside an instance, replicate across instances).
    zero1  optimizer / shard                       (megatron DDP's distributed optimizer, or FSDP 'optim')
    zero2  + gradients / shard                     (Megatron-FSDP 'optim_grads')
    zero3  + weights / shard, plus gathered layers (Megatron-FSDP 'optim_grads_params': one TransformerLayer
           unit in use and the next prefetched, at full size)
Optimizer offload (megatron-core's HybridDeviceOptimizer inside the distributed optimizer): the fp32
master shard stays on the GPU (the distributed optimizer owns it); ``offload_fraction`` of the shard's
moments leave the GPU, and the host holds, for that fraction, a pinned fp32 copy of the master, the two
moments and a pinned fp32 gradient copy: 16 B per offloaded Adam parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Tuple

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate.params import ParamCount, layers_params, shard_of, stage_params

GB = 1e9
ZERO3_UNITS_IN_FLIGHT = 2  # the layer computing and the one prefetched


@dataclass(frozen=True)
class ShardGroups:
    dense: int  # ranks one dense parameter's state is split over
    expert: int


def shard_groups(cfg: RunConfig) -> ShardGroups:
    n = max(1, cfg.parallel.dist_optimizer_instances)
    dense = max(1, derived.data_parallel_size(cfg) * cfg.parallel.cp // n)
    expert = max(1, derived.expert_data_parallel_size(cfg) // n)
    return ShardGroups(dense, expert)


def _split(params: ParamCount, g: ShardGroups) -> float:
    return params.dense / g.dense + params.expert / g.expert


def moments_bytes_per_param(cfg: RunConfig) -> float:
    """Optimizer state besides the master copy: Adam m + v, SGD momentum."""
    o = cfg.optimizer
    if o.name == "sgd":
        return 4.0 if o.sgd_momentum > 0 else 0.0
    return 8.0


def device_state(
    cfg: RunConfig, params: ParamCount, weight_b: float, grad_b: float, opt_b: float
) -> Tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one GPU holding ``params``; ``*_b`` are bytes per parameter
    unsharded (``opt_b`` = master + moments)."""
    total = params.total
    if not cfg.optimizer.use_distributed_optimizer:
        return total * weight_b, total * grad_b, total * opt_b
    g = shard_groups(cfg)
    sharded = _split(params, g)
    if cfg.parallel.fsdp and cfg.precision.params_dtype == "fp32":
        # Megatron-FSDP keeps an fp32 main-weight shard even for fp32 params (DDP config
        # preserve_fp32_weights=True, megatron-core's default); megatron DDP optimizes fp32 params in place.
        opt_b += 4.0
    stage = cfg.parallel.sharding
    weights = sharded * weight_b if stage == "zero3" else total * weight_b
    grads = sharded * grad_b if stage in ("zero2", "zero3") else total * grad_b
    opt = sharded * opt_b
    if cfg.optimizer.cpu_offload:
        opt -= sharded * moments_bytes_per_param(cfg) * cfg.optimizer.offload_fraction
    return weights, grads, opt


def gather_transient(cfg: RunConfig, layers, weight_b: float) -> float:
    """zero3: full-size weights of the FSDP units (TransformerLayers) gathered at once on this rank."""
    if cfg.parallel.sharding != "zero3" or not cfg.optimizer.use_distributed_optimizer or not layers:
        return 0.0
    one = layers_params(cfg.model, [layers[0]], shard_of(cfg)).total
    return min(ZERO3_UNITS_IN_FLIGHT, len(layers)) * one * weight_b


def host_bytes_per_rank(cfg: RunConfig, params: ParamCount) -> float:
    """Host RAM one rank's offloaded optimizer state takes (0 without ``optimizer.cpu_offload``)."""
    if not cfg.optimizer.cpu_offload or not cfg.optimizer.use_distributed_optimizer:
        return 0.0
    master = 4.0
    per = master + moments_bytes_per_param(cfg) + 4.0  # + pinned fp32 grad copy
    return _split(params, shard_groups(cfg)) * per * cfg.optimizer.offload_fraction


@dataclass(frozen=True)
class HostMemory:
    per_node: float  # bytes of offloaded state on the fullest node
    capacity: float  # cluster.host_memory_gb in bytes (0 = unknown)

    @property
    def fits(self) -> bool:
        return self.per_node == 0 or (self.capacity > 0 and self.per_node <= self.capacity)


def host_memory(cfg: RunConfig) -> HostMemory:
    """Offloaded bytes per node: every rank of a node (``gpus_per_node``) at its pipeline stage's size.

    megatron-core's default order puts consecutive ranks in TP, then DP, then PP, so a node holds the
    ranks of one or more whole stages; the estimate takes the fullest stage for all of the node's ranks.
    """
    worst = max(host_bytes_per_rank(cfg, stage_params(cfg, r)) for r in range(max(1, cfg.parallel.pp)))
    return HostMemory(worst * cfg.cluster.gpus_per_node, cfg.cluster.host_memory_gb * GB)


def escalations(cfg: RunConfig) -> List[Tuple[str, RunConfig]]:
    """Sharding modes beyond the recipe's own, cheapest first, that ``plan --search`` tries when the
    recipe's mode leaves too few layouts that fit. Each is named and returned as a whole RunConfig.

    ZeRO-1 (distributed optimizer), then Megatron-FSDP zero2 and zero3, then zero3 with the optimizer
    moments on the host (GPU clusters whose RAM is known, bf16/fp16 Adam only: the rules refuse the rest).
    Megatron-FSDP saves and resumes only at TP=1, dense, without offload (rule fsdp.checkpoint_format), so
    these modes keep checkpoints off in their overrides (conservative; the search keeps the recipe's TP).
    """
    o, p = cfg.optimizer, cfg.parallel
    if o.name != "adam" or cfg.peft.method != "none":
        return []
    order = [("zero1", False, False), ("zero2", True, False), ("zero3", True, False), ("zero3", True, True)]
    here = (p.sharding, p.fsdp, o.cpu_offload) if o.use_distributed_optimizer else None
    out: List[Tuple[str, RunConfig]] = []
    passed = here is None
    for stage, fsdp, offload in order:
        if not passed:
            passed = (stage, fsdp, offload) == here
            continue
        if offload and (cfg.cluster.gpu_arch == "cpu" or cfg.cluster.host_memory_gb <= 0 or cfg.precision.params_dtype == "fp32"):
            continue
        par = dataclasses.replace(p, sharding=stage, fsdp=fsdp, pp=1 if fsdp else p.pp)
        opt = dataclasses.replace(o, use_distributed_optimizer=True, cpu_offload=offload)
        ckpt = dataclasses.replace(cfg.checkpoint, save=False, load="none") if fsdp else cfg.checkpoint
        name = stage + (" (Megatron-FSDP)" if fsdp else "") + (" + optimizer offload" if offload else "")
        out.append((name, dataclasses.replace(cfg, parallel=par, optimizer=opt, checkpoint=ckpt)))
    return out


def overrides(cfg: RunConfig) -> List[str]:
    """Hydra overrides that select ``cfg``'s sharding mode (for a search result's command line)."""
    p, o = cfg.parallel, cfg.optimizer
    out = [f"optimizer.use_distributed_optimizer={str(o.use_distributed_optimizer).lower()}",
           f"parallel.sharding={p.sharding}", f"parallel.fsdp={str(p.fsdp).lower()}",
           f"optimizer.cpu_offload={str(o.cpu_offload).lower()}"]
    if p.fsdp:
        out += ["checkpoint.save=false", "checkpoint.load=none"]
    return out
