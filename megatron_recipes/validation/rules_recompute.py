"""Rules on selective recompute by module (``train.recompute_modules``, megatron-core's recompute_modules).

What megatron-core's TransformerConfig refuses is said here first, by field, and so is a module that would
recompute nothing in the model (megatron-core accepts those and changes nothing: a recipe that believes it
saves memory it does not). What each module recomputes is the cost model's knowledge
(``estimate/activations.py``: ``idle_module``); the differences between releases are in
``runtime/mcore_compat.py``.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config.schema import RECOMPUTE_MODULES, RunConfig
from megatron_recipes.estimate.activations import idle_module
from megatron_recipes.validation.rules_base import Host, choices, rule

DEFAULT = ["core_attn"]  # TrainConfig's default, and megatron-core's
OVERLAP = "parallel.overlap_moe_expert_parallel_comm"
TE_FP8_RECOMPUTE = (2, 6)  # megatron-core: moe_act / layernorm recompute under FP8 needs transformer-engine>=2.6


def _modules(cfg: RunConfig) -> list:
    return list(cfg.train.recompute_modules) if cfg.train.recompute == "selective" else []


@rule(
    "recompute.modules_values",
    ["train.recompute_modules"],
    "train.recompute_modules lists megatron-core's recompute modules, each once, at least one",
    f"use names from {choices(RECOMPUTE_MODULES)}",
)
def _values(cfg: RunConfig) -> Optional[str]:
    mods = list(cfg.train.recompute_modules)
    unknown = [m for m in mods if m not in RECOMPUTE_MODULES]
    if unknown:
        return f"train.recompute_modules has unknown module(s) {unknown}; valid names: {choices(RECOMPUTE_MODULES)}"
    if len(set(mods)) != len(mods):
        return f"train.recompute_modules={mods} names a module twice"
    if not mods:
        return "train.recompute_modules is empty: selective recompute would recompute nothing (use train.recompute=none)"
    return None


@rule(
    "recompute.modules_need_selective",
    ["train.recompute_modules", "train.recompute"],
    "train.recompute_modules is read with train.recompute=selective only (full recomputes whole layers)",
    "set train.recompute=selective, or leave train.recompute_modules at [core_attn] (its default)",
)
def _need_selective(cfg: RunConfig) -> Optional[str]:
    t = cfg.train
    if t.recompute != "selective" and list(t.recompute_modules) != DEFAULT:
        return (f"train.recompute_modules={list(t.recompute_modules)} with train.recompute={t.recompute}: the modules "
                "would be ignored; set train.recompute=selective to recompute them")
    return None


@rule(
    "recompute.modules_in_model",
    ["train.recompute_modules", "model.*", "cluster.gpu_arch"],
    "each recompute module has something to recompute in this model (MLA for mla_up_proj, MoE layers for moe, "
    "moe_act and shared_experts, dense layers for mlp, a norm module for layernorm)",
    "leave the module out of train.recompute_modules",
)
def _in_model(cfg: RunConfig) -> Optional[str]:
    idle = [(m, idle_module(cfg, m)) for m in _modules(cfg) if m in RECOMPUTE_MODULES]
    idle = [(m, why) for m, why in idle if why]
    if not idle:
        return None
    return "; ".join(f"train.recompute_modules has {m}, but {why}" for m, why in idle)


@rule(
    "recompute.fp8_delayed",
    ["train.recompute_modules", "precision.fp8_recipe"],
    "moe_act and layernorm recompute do not work with FP8 delayed scaling (megatron-core refuses them)",
    "use another FP8 recipe (precision=fp8_tensorwise, fp8_blockwise, mxfp8), or leave moe_act/layernorm out",
)
def _fp8_delayed(cfg: RunConfig) -> Optional[str]:
    prec = cfg.precision
    both = [m for m in _modules(cfg) if m in ("moe_act", "layernorm")]
    if both and prec.fp8 and prec.fp8_recipe == "delayed":
        return f"train.recompute_modules has {both} with precision.fp8_recipe=delayed ({prec.name})"
    return None


@rule(
    "recompute.moe_with_ep_overlap",
    ["train.recompute_modules", OVERLAP],
    "the EP communication overlap does not recompute whole MoE layers (moe)",
    "recompute parts of the MoE layer instead (moe_act, shared_experts), or set "
    "parallel.overlap_moe_expert_parallel_comm=false",
)
def _moe_overlap(cfg: RunConfig) -> Optional[str]:
    if "moe" in _modules(cfg) and cfg.parallel.overlap_moe_expert_parallel_comm:
        return (f"train.recompute_modules has moe with {OVERLAP}=true: the combined 1F1B schedule runs the MoE layer's "
                "router, dispatch, experts and combine as separate steps, past the checkpoint around the layer "
                "(megatron-core 0.17+ refuses it; 0.16 would silently recompute nothing)")
    return None


@rule(
    "machine.recompute_modules_need_te",
    ["train.recompute_modules", "precision.fp8"],
    "moe_act recompute runs in Transformer Engine's grouped experts on a GPU; under FP8, moe_act and layernorm "
    "recompute need Transformer Engine 2.6+",
    "leave moe_act out of train.recompute_modules (recompute the experts with moe instead)",
    scope="machine",
)
def _need_te(cfg: RunConfig, host: Host) -> Optional[str]:
    mods, m = _modules(cfg), host.machine
    te = bool(m.cuda and m.transformer_engine)
    if "moe_act" in mods and not te:
        where = "this machine has no GPU" if not m.cuda else "Transformer Engine is not importable here"
        return (f"train.recompute_modules has moe_act, but {where}: megatron-core recomputes the expert activation "
                "only in grouped experts (moe_grouped_gemm, Transformer Engine's here) and refuses it otherwise")
    both = [name for name in mods if name in ("moe_act", "layernorm")]
    have = tuple(getattr(m, "te_version", ()) or ())
    if both and cfg.precision.fp8 and te and have < TE_FP8_RECOMPUTE:
        found = ".".join(map(str, have)) if have else "an unreadable version"
        return (f"train.recompute_modules has {both} under FP8, which megatron-core allows from Transformer Engine 2.6; "
                f"found {found}")
    return None


RECOMPUTE_RULES = [_values, _need_selective, _in_model, _fp8_delayed, _moe_overlap]
RECOMPUTE_MACHINE_RULES = [_need_te]
