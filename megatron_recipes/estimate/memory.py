"""Per-GPU memory estimate for every pipeline stage, and the fits / does-not-fit verdict.

Model state per parameter on a rank (``params_dtype`` bf16 shown):
    weights 2 B, gradients 4 B (megatron DDP accumulates fp32 main grads when grad_reduce_in_fp32),
    optimizer 12 B (fp32 master + Adam m + v), divided by DP x CP for dense parameters and by expert-DP
    for routed experts when the distributed optimizer shards them.
Activations: ``activations.chunk_bytes`` per microbatch times the microbatches in flight at the stage's
peak (``schedule``), plus what full recompute rebuilds during backward.
Sharding (ZeRO stages, hybrid instances) and optimizer offload: ``estimate/sharding.py``.
PEFT (any ``peft.method`` but none) freezes the base: its weights stay, its gradients and optimizer state
go; the small adapters are not counted, and NF4 storage is counted at the bf16 size (conservative).
Overhead: CUDA context, NCCL buffers and allocator fragmentation, a fixed amount plus a share.
The verdict compares the worst stage with ``cluster.gpu_memory_gb`` (GB = 1e9 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate import activations, schedule, sharding
from megatron_recipes.estimate.params import ParamCount, stage_params

GB = 1e9
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GPU_FIXED_OVERHEAD = 2.0 * GB  # CUDA context + NCCL communicators + cuBLAS/TE workspaces
CPU_FIXED_OVERHEAD = 0.5 * GB  # interpreter, torch and megatron-core in each rank process
FRAGMENTATION = 0.05  # caching-allocator slack on top of live tensors


@dataclass(frozen=True)
class StageMemory:
    pp_rank: int
    params: ParamCount
    weights: float
    grads: float
    optimizer: float
    activations: float  # in-flight microbatches x per-microbatch bytes
    per_microbatch: float
    in_flight: float  # whole-stage microbatches alive at the peak
    transient: float  # recompute rebuild
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.overhead


@dataclass(frozen=True)
class MemoryEstimate:
    stages: List[StageMemory]
    capacity: float  # bytes per GPU
    bubble_fraction: float

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def margin(self) -> float:
        """Spare bytes on the fullest GPU (negative: short by that much)."""
        return self.capacity - self.worst.total

    @property
    def fits(self) -> bool:
        return self.margin >= 0


def optimizer_bytes_per_param(cfg: RunConfig) -> float:
    """Optimizer state per parameter before sharding: fp32 master copy (unless params are fp32) + moments."""
    o, master = cfg.optimizer, 0 if cfg.precision.params_dtype == "fp32" else 4
    if o.name == "sgd":
        return master + (4 if o.sgd_momentum > 0 else 0)
    return master + 8


def weight_bytes_per_param(cfg: RunConfig) -> float:
    """Weight storage per parameter. FP8 recipes: with ``fp8_param_gather`` the weights are FP8 (1 B),
    otherwise bf16 plus the FP8 copy TE casts each step (+1 B); on Hopper TE also caches the FP8
    transpose for the backward GEMMs (+1 B; Blackwell's tensor cores read either layout). Counted for
    every parameter (embeddings stay bf16: a slight overcount)."""
    prec = cfg.precision
    base = _DTYPE_BYTES.get(prec.params_dtype, 2)
    if not (prec.fp8 or prec.fp4) or cfg.cluster.gpu_arch == "cpu":
        return 1 if prec.fp8_param_gather else base
    fp8 = 1 + (1 if cfg.cluster.gpu_arch == "hopper" else 0)
    return fp8 if prec.fp8_param_gather else base + fp8


def model_state_bytes(cfg: RunConfig, params: ParamCount) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one rank holding ``params``; separate figures so that a
    sharding divisor (FSDP) applies to each cleanly."""
    prec = cfg.precision
    weight = weight_bytes_per_param(cfg)
    grad = 4 if (prec.grad_reduce_in_fp32 or prec.params_dtype == "fp32") else 2
    per = optimizer_bytes_per_param(cfg)
    if cfg.peft.method != "none":  # frozen base: no grads or optimizer state (adapters are not counted)
        return params.total * weight, 0.0, 0.0
    return sharding.device_state(cfg, params, weight, grad, per)  # ZeRO stage, hybrid sharding, offload


def stage_memory(cfg: RunConfig, pp_rank: int) -> StageMemory:
    pp = max(1, cfg.parallel.pp)
    params = stage_params(cfg, pp_rank)
    weights, grads, opt = model_state_bytes(cfg, params)
    chunks = derived.pipeline_stage_layers(cfg)[pp_rank]
    vpp = len(chunks)
    first, last = pp_rank == 0, pp_rank == pp - 1
    chunk_act = [
        activations.chunk_bytes(cfg, list(c), first=first and v == 0, last=last and v == vpp - 1)
        for v, c in enumerate(chunks)
    ]
    per_mb = sum(chunk_act)
    n_chunks = schedule.chunk_microbatches_in_flight(cfg, pp_rank)
    head = activations.head_bytes(cfg) if last else 0.0
    # the head's logits live for one microbatch (the loss runs its backward at once); layers for all
    layer_part = (per_mb - head) / vpp
    acts = layer_part * n_chunks + head
    transient = max((activations.recompute_transient_bytes(cfg, list(c)) for c in chunks), default=0.0)
    transient += sharding.gather_transient(cfg, [i for c in chunks for i in c], weight_bytes_per_param(cfg))
    fixed = CPU_FIXED_OVERHEAD if cfg.cluster.gpu_arch == "cpu" else GPU_FIXED_OVERHEAD
    overhead = fixed + FRAGMENTATION * (weights + grads + opt + acts + transient)
    return StageMemory(pp_rank, params, weights, grads, opt, acts, per_mb, n_chunks / vpp, transient, overhead)


def estimate_memory(cfg: RunConfig) -> MemoryEstimate:
    """Every stage's estimate; the caller must have validated the layout (rules check the split)."""
    stages = [stage_memory(cfg, r) for r in range(max(1, cfg.parallel.pp))]
    return MemoryEstimate(stages, cfg.cluster.gpu_memory_gb * GB, schedule.bubble_fraction(cfg))
