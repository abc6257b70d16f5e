"""Rules on ZeRO-style sharding and offload: what megatron-core 0.16 accepts, and what needs a GPU.

Keys (mapped in training/optim.py and models/transformer_config.py):
    parallel.sharding (zero1|zero2|zero3), parallel.fsdp (Megatron-FSDP), parallel.dist_optimizer_instances
    (hybrid sharding), optimizer.cpu_offload / offload_fraction, train.activation_offload_layers.
Where a combination fails inside megatron-core (an assert or a crash) the rule names the call; where it
is refused because this project has not proven it, the rule says so.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import choices, divisors, is_gpu, one_of, rule, world_ok

SHARDING = ("zero1", "zero2", "zero3")


def _sharded_dp(cfg: RunConfig) -> bool:
    """Anything beyond megatron DDP's own distributed optimizer (ZeRO-1 over the whole DP group)."""
    p = cfg.parallel
    return p.fsdp or p.sharding != "zero1" or p.dist_optimizer_instances != 1


@rule(
    "sharding.values",
    ["parallel.sharding", "parallel.dist_optimizer_instances", "optimizer.offload_fraction", "train.activation_offload_layers"],
    "parallel.sharding is zero1, zero2 or zero3; dist_optimizer_instances >= 1; 0 < offload_fraction <= 1; "
    "activation_offload_layers >= 0",
    "use a listed value",
)
def _values(cfg: RunConfig) -> Optional[str]:
    bad = one_of(cfg.parallel.sharding, SHARDING, "parallel.sharding")
    if bad:
        return bad
    if cfg.parallel.dist_optimizer_instances < 1:
        return f"parallel.dist_optimizer_instances={cfg.parallel.dist_optimizer_instances} must be >= 1"
    if not 0.0 < cfg.optimizer.offload_fraction <= 1.0:
        return f"optimizer.offload_fraction={cfg.optimizer.offload_fraction} must be in (0, 1]"
    if cfg.train.activation_offload_layers < 0:
        return f"train.activation_offload_layers={cfg.train.activation_offload_layers} must be >= 0"
    return None


@rule(
    "sharding.needs_distributed_optimizer",
    ["parallel.sharding", "parallel.fsdp", "parallel.dist_optimizer_instances", "optimizer.use_distributed_optimizer"],
    "zero2/zero3, parallel.fsdp and dist_optimizer_instances > 1 shard through megatron-core's distributed optimizer",
    "set optimizer.use_distributed_optimizer=true (Adam), or parallel.sharding=zero1 parallel.fsdp=false "
    "parallel.dist_optimizer_instances=1",
)
def _needs_distopt(cfg: RunConfig) -> Optional[str]:
    # DistributedDataParallel asserts 'Partial DistOpt cannot be used without DistOpt'; Megatron-FSDP's
    # optimizer is megatron-core's DistributedOptimizer over the FSDP buffers (optimizer/__init__.py).
    if _sharded_dp(cfg) and not cfg.optimizer.use_distributed_optimizer:
        p = cfg.parallel
        return (
            f"parallel.sharding={p.sharding}, parallel.fsdp={p.fsdp}, parallel.dist_optimizer_instances="
            f"{p.dist_optimizer_instances} with optimizer.use_distributed_optimizer=false"
        )
    return None


@rule(
    "sharding.zero23_need_fsdp",
    ["parallel.sharding", "parallel.fsdp"],
    "zero2/zero3 need parallel.fsdp=true: megatron DDP's distributed optimizer keeps whole gradient buffers and "
    "parameters on every rank; only Megatron-FSDP shards them",
    "set parallel.fsdp=true, or parallel.sharding=zero1",
)
def _zero23_fsdp(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.sharding in ("zero2", "zero3") and not p.fsdp:
        return f"parallel.sharding={p.sharding} with parallel.fsdp=false shards only the optimizer state (ZeRO-1)"
    return None


@rule(
    "sharding.instances_divide_dp",
    ["parallel.dist_optimizer_instances", "parallel.tp", "parallel.pp", "parallel.cp", "cluster.nodes"],
    "parallel.dist_optimizer_instances divides DP x CP (each instance shards over DP x CP / instances ranks)",
    lambda cfg: f"use parallel.dist_optimizer_instances in "
    f"{choices(divisors(derived.data_parallel_size(cfg) * cfg.parallel.cp)) if world_ok(cfg) else '{1}'}",
)
def _instances(cfg: RunConfig) -> Optional[str]:
    n = cfg.parallel.dist_optimizer_instances
    if n < 1 or not world_ok(cfg):
        return None
    dp_cp = derived.data_parallel_size(cfg) * cfg.parallel.cp
    if dp_cp % n:  # parallel_state.initialize_model_parallel asserts the same
        return f"parallel.dist_optimizer_instances={n} does not divide DP x CP = {dp_cp}"
    return None


@rule(
    "fsdp.no_hybrid_instances",
    ["parallel.fsdp", "parallel.dist_optimizer_instances"],
    "Megatron-FSDP with dist_optimizer_instances > 1 (HSDP) is refused: with megatron-core 0.16 its gradients "
    "come out twice the one-rank run's, without an error (tests/test_sharding_equivalence.py)",
    "set parallel.dist_optimizer_instances=1 with parallel.fsdp=true, or parallel.fsdp=false for hybrid sharding",
)
def _fsdp_hsdp(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.fsdp and p.dist_optimizer_instances > 1:
        return f"parallel.fsdp=true with parallel.dist_optimizer_instances={p.dist_optimizer_instances}"
    return None


@rule(
    "fsdp.not_with_peft",
    ["parallel.fsdp", "peft.method"],
    "Megatron-FSDP is not combined with PEFT: the frozen base has no gradients or optimizer state to shard, "
    "and adapters on a Megatron-FSDP model are not proven here",
    "set parallel.fsdp=false (LoRA/QLoRA keep the distributed optimizer for their adapters)",
)
def _fsdp_peft(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.fsdp and cfg.peft.method != "none":
        return f"parallel.fsdp=true with peft.method={cfg.peft.method}"
    return None


@rule(
    "fsdp.fp8_params_from_checkpoint",
    ["parallel.fsdp", "precision.fp8_param_gather", "checkpoint.pretrained"],
    "Megatron-FSDP with FP8 parameters does not start from a checkpoint here: the weights load before wrapping, "
    "and Megatron-FSDP builds its fp32 main weights from the random init TE keeps on each FP8 weight "
    "(get_high_precision_init_val), so training would continue from that init after step 1",
    "set precision.fp8_param_gather=false to fine-tune under Megatron-FSDP, or parallel.fsdp=false "
    "(the distributed optimizer re-reads its main params from the loaded weights)",
)
def _fsdp_fp8_start(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.fsdp and cfg.precision.fp8_param_gather and cfg.checkpoint.pretrained:
        return f"parallel.fsdp=true, precision.fp8_param_gather=true and checkpoint.pretrained={cfg.checkpoint.pretrained}"
    return None


@rule(
    "fsdp.no_pipeline",
    ["parallel.fsdp", "parallel.pp", "parallel.vpp"],
    "Megatron-FSDP runs with PP=1 here: its per-chunk buffers under the pipeline schedules are not proven",
    "set parallel.pp=1 (shard with zero3 instead of pipelining), or parallel.fsdp=false",
)
def _fsdp_pp(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.fsdp and (p.pp > 1 or p.vpp is not None):
        return f"parallel.fsdp=true with parallel.pp={p.pp}, parallel.vpp={p.vpp}"
    return None


@rule(
    "fsdp.checkpoint_format",
    ["parallel.fsdp", "parallel.tp", "model.num_moe_experts", "optimizer.cpu_offload", "checkpoint.save",
     "checkpoint.load"],
    "Megatron-FSDP runs save and resume megatron-core's fsdp_dtensor format (checkpoint/_fsdp.py) with "
    "parallel.tp=1, a dense model and no optimizer offload: that is what is proven on the CPU lane "
    "(tests/test_checkpoint_fsdp.py); with TP > 1 its DTensors hold megatron-core's per-rank TP layout, expert "
    "parameters are not covered, and HybridDeviceOptimizer's state (GPU only) is not proven in that format",
    "set parallel.tp=1 (Megatron-FSDP shards what TP would) and optimizer.cpu_offload=false, or "
    "checkpoint.save=false checkpoint.load=none (checkpoint.pretrained still works), or parallel.fsdp=false",
)
def _fsdp_ckpt(cfg: RunConfig) -> Optional[str]:
    c = cfg.checkpoint
    if not (cfg.parallel.fsdp and (c.save or c.load != "none")):
        return None
    if cfg.parallel.tp > 1 or derived.is_moe(cfg.model) or cfg.optimizer.cpu_offload:
        return (
            f"parallel.fsdp=true with checkpoint.save={c.save}, checkpoint.load={c.load!r}, parallel.tp="
            f"{cfg.parallel.tp}, model.num_moe_experts={cfg.model.num_moe_experts}, optimizer.cpu_offload="
            f"{cfg.optimizer.cpu_offload}"
        )
    return None


@rule(
    "offload.needs_gpu",
    ["optimizer.cpu_offload", "train.activation_offload_layers", "cluster.gpu_arch"],
    "optimizer and activation offload need a GPU: HybridDeviceOptimizer splits state by Tensor.is_cuda and "
    "pins host copies; layer offload is Transformer Engine's get_cpu_offload_context",
    "set optimizer.cpu_offload=false train.activation_offload_layers=0 on the CPU lane",
)
def _offload_gpu(cfg: RunConfig) -> Optional[str]:
    if is_gpu(cfg):
        return None
    if cfg.optimizer.cpu_offload or cfg.train.activation_offload_layers > 0:
        return (
            f"optimizer.cpu_offload={cfg.optimizer.cpu_offload}, train.activation_offload_layers="
            f"{cfg.train.activation_offload_layers} on cluster {cfg.cluster.name} (gpu_arch=cpu)"
        )
    return None


@rule(
    "offload.optimizer_precision",
    ["optimizer.cpu_offload", "optimizer.name", "optimizer.use_distributed_optimizer", "precision.params_dtype",
     "precision.fp8_param_gather", "precision.fp8_recipe"],
    "optimizer.cpu_offload needs Adam, the distributed optimizer and bf16/fp16 params (fp32 main-param shards are "
    "views of the model params, which HybridDeviceOptimizer cannot own); with fp8_param_gather, the delayed recipe",
    "use optimizer=adam optimizer.use_distributed_optimizer=true precision=bf16 (fp8: precision.fp8_recipe=delayed)",
)
def _offload_precision(cfg: RunConfig) -> Optional[str]:
    o, prec = cfg.optimizer, cfg.precision
    if not o.cpu_offload:
        return None
    if o.name != "adam" or not o.use_distributed_optimizer:
        return f"optimizer.cpu_offload=true with optimizer.name={o.name}, use_distributed_optimizer={o.use_distributed_optimizer}"
    if prec.params_dtype == "fp32":
        return "optimizer.cpu_offload=true with precision.params_dtype=fp32 (torch: \"can't optimize a non-leaf Tensor\")"
    if prec.fp8_param_gather and prec.fp8_recipe != "delayed":
        return f"optimizer.cpu_offload=true with precision.fp8_param_gather=true and fp8_recipe={prec.fp8_recipe}"
    return None


@rule(
    "offload.host_memory_known",
    ["optimizer.cpu_offload", "cluster.host_memory_gb"],
    "optimizer.cpu_offload needs cluster.host_memory_gb (the node's RAM) so the host side can be checked",
    "set cluster.host_memory_gb to the node's RAM in GB",
)
def _host_known(cfg: RunConfig) -> Optional[str]:
    if cfg.optimizer.cpu_offload and cfg.cluster.host_memory_gb <= 0:
        return f"optimizer.cpu_offload=true but cluster {cfg.cluster.name} has host_memory_gb={cfg.cluster.host_memory_gb}"
    return None


@rule(
    "offload.activation_layers",
    ["train.activation_offload_layers", "parallel.pp", "train.recompute", "model.num_layers"],
    "train.activation_offload_layers < num_layers, with PP=1 and no recompute (megatron-core's TransformerConfig "
    "refuses cpu_offloading with pipeline parallelism or recomputation)",
    "lower train.activation_offload_layers, or set parallel.pp=1 and train.recompute=none",
)
def _act_offload(cfg: RunConfig) -> Optional[str]:
    n = cfg.train.activation_offload_layers
    if n <= 0:
        return None
    if n >= cfg.model.num_layers:
        return f"train.activation_offload_layers={n} must be < model.num_layers={cfg.model.num_layers}"
    if cfg.parallel.pp > 1 or cfg.train.recompute != "none":
        return f"train.activation_offload_layers={n} with parallel.pp={cfg.parallel.pp}, train.recompute={cfg.train.recompute}"
    return None


SHARDING_RULES = [
    _values,
    _needs_distopt,
    _zero23_fsdp,
    _instances,
    _fsdp_hsdp,
    _fsdp_peft,
    _fsdp_fp8_start,
    _fsdp_pp,
    _fsdp_ckpt,
    _offload_gpu,
    _offload_precision,
    _host_known,
    _act_offload,
]
