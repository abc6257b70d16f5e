"""Rules on number formats against the declared GPU generation (static: the recipe vs its cluster).

Whether Transformer Engine is importable on the machine that runs is the trainer's check; here we only
compare the recipe with what the cluster config says its GPUs are.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import choices, one_of, rule

GPU_ARCHS = ("cpu", "ampere", "hopper", "blackwell")
PARAM_DTYPES = ("fp32", "bf16", "fp16")
FP8_FORMATS = (None, "e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP4_FORMATS = (None, "nvfp4")
FP8_ARCHS = ("hopper", "blackwell")


@rule("cluster.gpu_arch", ["cluster.gpu_arch"], "cluster.gpu_arch is cpu, ampere, hopper or blackwell", "use a listed value")
def _arch(cfg: RunConfig) -> Optional[str]:
    return one_of(cfg.cluster.gpu_arch, GPU_ARCHS, "cluster.gpu_arch")


_RATES = ("peak_bf16_tflops", "peak_fp8_tflops", "peak_fp4_tflops", "hbm_bw_gbps", "intra_node_bw_gbps", "inter_node_bw_gbps")


@rule(
    "cluster.memory",
    ["cluster.gpu_memory_gb", "cluster.peak_bf16_tflops", "cluster.peak_fp8_tflops", "cluster.peak_fp4_tflops",
     "cluster.hbm_bw_gbps", "cluster.intra_node_bw_gbps", "cluster.inter_node_bw_gbps"],
    "device memory is positive; peak FLOP/s and bandwidths are non-negative (0 = unknown)",
    "fix the cluster config",
)
def _memory(cfg: RunConfig) -> Optional[str]:
    c = cfg.cluster
    if c.gpu_memory_gb <= 0:
        return f"cluster.gpu_memory_gb={c.gpu_memory_gb} must be > 0"
    bad = [f"cluster.{n}={getattr(c, n)}" for n in _RATES if getattr(c, n) < 0]
    return f"{', '.join(bad)} must be >= 0" if bad else None


@rule(
    "precision.values",
    ["precision.params_dtype", "precision.fp8", "precision.fp8_recipe", "precision.fp4"],
    "precision fields take megatron-core's values",
    "use precision=bf16, fp32, fp8_delayed, fp8_tensorwise, fp8_blockwise, mxfp8 or nvfp4",
)
def _values(cfg: RunConfig) -> Optional[str]:
    p = cfg.precision
    return (
        one_of(p.params_dtype, PARAM_DTYPES, "precision.params_dtype")
        or one_of(p.fp8, FP8_FORMATS, "precision.fp8")
        or one_of(p.fp8_recipe, FP8_RECIPES, "precision.fp8_recipe")
        or one_of(p.fp4, FP4_FORMATS, "precision.fp4")
    )


@rule(
    "precision.fp8_needs_hopper",
    ["precision.fp8", "cluster.gpu_arch"],
    "FP8 training needs Hopper or newer GPUs",
    "use precision=bf16 on this cluster, or a Hopper/Blackwell cluster",
)
def _fp8_arch(cfg: RunConfig) -> Optional[str]:
    arch = cfg.cluster.gpu_arch
    if cfg.precision.fp8 and arch not in FP8_ARCHS:
        return f"precision.fp8={cfg.precision.fp8} on cluster {cfg.cluster.name} (gpu_arch={arch}); FP8 needs gpu_arch in {choices(FP8_ARCHS)}"
    return None


@rule(
    "precision.mxfp8_needs_blackwell",
    ["precision.fp8_recipe", "cluster.gpu_arch"],
    "MXFP8 (microscaling) needs Blackwell GPUs",
    "use precision=fp8_blockwise or fp8_tensorwise on Hopper",
)
def _mxfp8(cfg: RunConfig) -> Optional[str]:
    p, arch = cfg.precision, cfg.cluster.gpu_arch
    if p.fp8 and p.fp8_recipe == "mxfp8" and arch != "blackwell":
        return f"precision.fp8_recipe=mxfp8 on gpu_arch={arch}; MXFP8 needs blackwell"
    return None


@rule(
    "precision.nvfp4_needs_blackwell",
    ["precision.fp4", "cluster.gpu_arch"],
    "NVFP4 needs Blackwell GPUs",
    "use precision=bf16 or an FP8 precision on this cluster",
)
def _nvfp4(cfg: RunConfig) -> Optional[str]:
    p, arch = cfg.precision, cfg.cluster.gpu_arch
    if p.fp4 and arch != "blackwell":
        return f"precision.fp4={p.fp4} on gpu_arch={arch}; NVFP4 needs blackwell"
    return None


@rule(
    "precision.fp8_fp4_exclusive",
    ["precision.fp8", "precision.fp4"],
    "FP8 and FP4 cannot be combined",
    "set precision.fp8=null or precision.fp4=null",
)
def _exclusive(cfg: RunConfig) -> Optional[str]:
    p = cfg.precision
    return f"precision.fp8={p.fp8} and precision.fp4={p.fp4} are both set" if p.fp8 and p.fp4 else None


@rule(
    "precision.low_precision_needs_half_params",
    ["precision.fp8", "precision.fp4", "precision.params_dtype"],
    "FP8/FP4 recipes run on top of bf16 (or fp16) mixed precision",
    "set precision.params_dtype=bf16",
)
def _half_params(cfg: RunConfig) -> Optional[str]:
    p = cfg.precision
    if (p.fp8 or p.fp4) and p.params_dtype == "fp32":
        return f"precision.fp8={p.fp8} / fp4={p.fp4} with precision.params_dtype=fp32; use bf16"
    return None


@rule(
    "precision.fp8_param_gather",
    ["precision.fp8_param_gather", "precision.fp8", "optimizer.use_distributed_optimizer"],
    "FP8 parameter all-gather needs FP8 and the distributed optimizer",
    "set precision.fp8_param_gather=false, or enable FP8 and the distributed optimizer",
)
def _param_gather(cfg: RunConfig) -> Optional[str]:
    p = cfg.precision
    if not p.fp8_param_gather:
        return None
    if not p.fp8:
        return "precision.fp8_param_gather=true but precision.fp8 is not set"
    if not cfg.optimizer.use_distributed_optimizer:
        return "precision.fp8_param_gather=true needs optimizer.use_distributed_optimizer=true"
    return None


@rule(
    "precision.fp8_gemm_shapes",
    ["precision.fp8", "precision.fp4", "model.hidden_size", "model.ffn_hidden_size", "parallel.tp"],
    "FP8/FP4 GEMMs need hidden and FFN widths per TP rank divisible by 16",
    "use a TP degree that keeps hidden/tp and ffn/tp multiples of 16, or bf16",
)
def _gemm_shapes(cfg: RunConfig) -> Optional[str]:
    p, m, tp = cfg.precision, cfg.model, max(1, cfg.parallel.tp)
    if not (p.fp8 or p.fp4):
        return None
    widths = {"model.hidden_size": m.hidden_size, "model.ffn_hidden_size": m.ffn_hidden_size}
    if m.moe_ffn_hidden_size:
        widths["model.moe_ffn_hidden_size"] = m.moe_ffn_hidden_size
    bad = [f"{k}={v} / tp={tp}" for k, v in widths.items() if v % tp or (v // tp) % 16]
    return f"{', '.join(bad)} is not a multiple of 16 for FP8/FP4 GEMMs" if bad else None


PRECISION_RULES = [
    _arch,
    _memory,
    _values,
    _fp8_arch,
    _mxfp8,
    _nvfp4,
    _exclusive,
    _half_params,
    _param_gather,
    _gemm_shapes,
]
