"""The memory rule: the fullest GPU of the layout must fit the cluster's device memory.

The estimate itself is the cost model's (``estimate/memory.py``, ``estimate/sharding.py``), the one ``plan``
prints; the rule asks for its verdict only once the layout is otherwise sound.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate.memory import GB, estimate_memory
from megatron_recipes.estimate.sharding import host_memory
from megatron_recipes.validation.rules_base import batch_ok, layers_ok, model_ok, rule


@rule(
    "memory.fits",
    ["parallel.*", "train.micro_batch_size", "train.recompute", "cluster.gpu_memory_gb"],
    "the estimated peak memory of the fullest GPU fits cluster.gpu_memory_gb",
    "raise parallel.tp/pp (or cp/ep), lower train.micro_batch_size, set train.recompute=selective or full, "
    "shard more (parallel.fsdp=true parallel.sharding=zero3, then optimizer.cpu_offload=true), "
    "or run `megatron-recipes plan <recipe> --search` for layouts that fit",
)
def _fits(cfg: RunConfig) -> Optional[str]:
    if not (model_ok(cfg) and layers_ok(cfg) and batch_ok(cfg)) or cfg.cluster.gpu_memory_gb <= 0:
        return None
    est = estimate_memory(cfg)
    if est.fits:
        return None
    w = est.worst
    return (
        f"pipeline stage {w.pp_rank} needs about {w.total / GB:.1f} GB per GPU "
        f"(weights {w.weights / GB:.1f}, grads {w.grads / GB:.1f}, optimizer {w.optimizer / GB:.1f}, "
        f"activations {w.activations / GB:.1f}) but cluster {cfg.cluster.name} has {cfg.cluster.gpu_memory_gb:g} GB; "
        f"short by {-est.margin / GB:.1f} GB" + _precision_hint(cfg, w)
    )


def _precision_hint(cfg: RunConfig, w) -> str:
    """Settings NVIDIA's published FP8 runs use that shrink model state, when this recipe lacks them."""
    prec, hints = cfg.precision, []
    if (prec.fp8 or prec.fp4) and not prec.fp8_param_gather and prec.fp8:
        hints.append("precision.fp8_param_gather=true keeps the weights in FP8 (drops the bf16 copy)")
    if prec.grad_reduce_in_fp32 and prec.params_dtype != "fp32" and w.grads:
        hints.append(f"precision.grad_reduce_in_fp32=false halves the gradients ({w.grads / 2 / 1e9:.1f} GB)")
    return ("; as in the published runs, " + " and ".join(hints)) if hints else ""



@rule(
    "memory.host_fits",
    ["optimizer.cpu_offload", "optimizer.offload_fraction", "parallel.*", "cluster.host_memory_gb"],
    "offloaded optimizer state of all ranks of a node fits cluster.host_memory_gb",
    "lower optimizer.offload_fraction, shard over more ranks (more nodes or parallel.dist_optimizer_instances=1), "
    "or use nodes with more RAM",
)
def _host_fits(cfg: RunConfig) -> Optional[str]:
    if not cfg.optimizer.cpu_offload or cfg.cluster.host_memory_gb <= 0 or not (model_ok(cfg) and layers_ok(cfg) and batch_ok(cfg)):
        return None
    host = host_memory(cfg)
    if host.fits:
        return None
    return (
        f"offloaded optimizer state needs about {host.per_node / GB:.0f} GB of host memory per node but cluster "
        f"{cfg.cluster.name} has host_memory_gb={cfg.cluster.host_memory_gb:g}; short by {(host.per_node - host.capacity) / GB:.0f} GB"
    )


MEMORY_RULES = [_fits, _host_fits]
