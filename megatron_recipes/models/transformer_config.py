"""The one mapping from a recipe to megatron-core's ``TransformerConfig`` (or ``MLATransformerConfig``).

Every recipe setting megatron-core understands reaches it here and only here, so a CLI override can
never be overwritten later by a preset, and conversion, training and planning build the same model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP4_ELEMENT_FORMAT = {"nvfp4": "e2m1"}  # recipe name -> megatron-core's TransformerConfig.fp4


def params_dtype(cfg: RunConfig) -> torch.dtype:
    return _DTYPES[cfg.precision.params_dtype]


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


# model.activation (schema.ACTIVATIONS; rule model.option_values) -> megatron-core's activation fields.
_ACTIVATIONS: Dict[str, Dict[str, Any]] = {
    "swiglu": {"activation_func": F.silu, "gated_linear_unit": True},
    "gelu": {"activation_func": F.gelu, "gated_linear_unit": False},
    "squared_relu": {"activation_func": _squared_relu, "gated_linear_unit": False},
}


def _parallel_fields(cfg: RunConfig, on_gpu: bool) -> Dict[str, Any]:
    p = cfg.parallel
    return {
        "tensor_model_parallel_size": p.tp,
        "pipeline_model_parallel_size": p.pp,
        "virtual_pipeline_model_parallel_size": p.vpp,
        "context_parallel_size": p.cp,
        "expert_model_parallel_size": p.ep,
        "expert_tensor_parallel_size": derived.expert_tensor_parallel_size(cfg),
        "sequence_parallel": p.sp,
        "cp_comm_type": p.cp_comm_type,
        "hierarchical_context_parallel_sizes": p.cp_hierarchical_sizes,
        "num_layers_in_first_pipeline_stage": p.num_layers_in_first_pipeline_stage,
        "num_layers_in_last_pipeline_stage": p.num_layers_in_last_pipeline_stage,
        "account_for_embedding_in_pipeline_split": p.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": p.account_for_loss_in_pipeline_split,
        "pipeline_model_parallel_layout": p.pipeline_layout,
        # Megatron-LM's defaults: unbatched p2p, overlapped under VPP. On gloo (CPU lane) both the batched
        # path and the overlapped one gave wrong PP=2 x VPP=2 losses without any error (messages to the
        # same peer matched out of order / send buffers released before the async send read them), so
        # there the interleaved schedule communicates unbatched and waits for each exchange.
        "batch_p2p_comm": False,
        "overlap_p2p_comm": p.vpp is not None and on_gpu,
        # EP all-to-all hidden behind another micro-batch (megatron-core picks its combined 1F1B schedule from
        # this field; training/step.py's forward step builds the schedule plan it asks for) and weight
        # gradients deferred into that overlap (training/optim.py gives DDP the same flag). Rules ep_overlap.*.
        "overlap_moe_expert_parallel_comm": p.overlap_moe_expert_parallel_comm,
        "delay_wgrad_compute": p.delay_wgrad_compute,
    }


def _precision_fields(cfg: RunConfig) -> Dict[str, Any]:
    prec = cfg.precision
    dtype = params_dtype(cfg)
    out: Dict[str, Any] = {
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": prec.params_dtype == "bf16",
        "fp16": prec.params_dtype == "fp16",
    }
    if prec.fp8:
        out.update(fp8=prec.fp8, fp8_recipe=prec.fp8_recipe, fp8_param=prec.fp8_param_gather)
        if prec.fp8_recipe == "delayed":
            # megatron-core's defaults (history 1, most_recent) make delayed scaling follow the previous
            # step's amax alone; NeMo's FP8 recipes and Transformer Engine's own DelayedScaling default
            # keep 1024 steps and take their max, which survives one outlier-free step.
            out.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    if prec.fp4:
        # megatron-core: ``fp4`` is the element format (only 'e2m1'), ``fp4_recipe`` the scaling recipe.
        out.update(fp4=FP4_ELEMENT_FORMAT[prec.fp4], fp4_recipe=prec.fp4)
    return out


def _moe_fields(cfg: RunConfig, use_te: bool) -> Dict[str, Any]:
    m = cfg.model
    if not derived.is_moe(m):
        return {}
    p = cfg.parallel
    out: Dict[str, Any] = {
        "num_moe_experts": m.num_moe_experts,
        "moe_router_topk": m.moe_router_topk,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "moe_layer_freq": derived.moe_layer_pattern(m),
        "moe_router_score_function": m.moe_router_score_function,
        "moe_router_pre_softmax": m.moe_router_pre_softmax,
        "moe_router_num_groups": m.moe_router_num_groups,
        "moe_router_group_topk": m.moe_router_group_topk,
        "moe_router_topk_scaling_factor": m.moe_router_topk_scaling_factor,
        "moe_router_enable_expert_bias": m.moe_router_enable_expert_bias,
        "moe_router_load_balancing_type": m.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": p.moe_dispatcher,
        "moe_grouped_gemm": use_te,
    }
    if p.moe_dispatcher == "flex":
        out["moe_flex_dispatcher_backend"] = p.moe_flex_backend
    return out


def _recompute_fields(cfg: RunConfig) -> Dict[str, Any]:
    t = cfg.train
    if t.recompute == "none":
        return {}
    if t.recompute == "selective":  # the modules as listed (rules recompute.modules_*; megatron-core's own default
        # is core attention alone, as train.recompute_modules' is)
        return {"recompute_granularity": "selective", "recompute_modules": list(t.recompute_modules)}
    return {  # "full" (schema.RECOMPUTE; rule recompute.values)
        "recompute_granularity": "full",
        "recompute_method": t.recompute_method,
        "recompute_num_layers": t.recompute_num_layers,
    }


def _offload_fields(cfg: RunConfig) -> Dict[str, Any]:
    """``train.activation_offload_layers`` -> megatron-core's layer-level ``cpu_offloading`` and
    ``cpu_offloading_num_layers`` (model_parallel_config.py). TransformerBlock builds the offload context
    with Transformer Engine's ``get_cpu_offload_context`` and asserts without it; megatron-core refuses it
    with PP > 1 and with recompute (transformer_config.py) - the rule table says so before this runs."""
    n = cfg.train.activation_offload_layers
    if n <= 0:
        return {}
    return {"cpu_offloading": True, "cpu_offloading_num_layers": n, "cpu_offloading_activations": True}


def _mla_fields(cfg: RunConfig) -> Dict[str, Any]:
    m = cfg.model
    out: Dict[str, Any] = {
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_head_dim": m.qk_head_dim,
        "qk_pos_emb_head_dim": m.qk_pos_emb_head_dim,
        "v_head_dim": m.v_head_dim,
        "rotary_base": m.rotary_base,
    }
    rs = m.rope_scaling
    if rs is None:
        out.update(rope_type="rope")
    else:  # yarn: the rule model.rope_scaling_mcore (required below) allows no other type with MLA
        out.update(
            rope_type="yarn",
            rotary_scaling_factor=rs.factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
            beta_fast=rs.beta_fast,
            beta_slow=rs.beta_slow,
            mscale=rs.mscale,
            mscale_all_dim=rs.mscale_all_dim,
        )
    return out


def fusions_off() -> Dict[str, bool]:
    from megatron_recipes.models.fusions import FIELDS

    return {name: False for name in FIELDS.values()}


def build_transformer_config(cfg: RunConfig, use_te: bool, cpu_init: bool, fusions: Optional[Dict[str, bool]] = None):
    """RunConfig -> TransformerConfig / MLATransformerConfig for this machine (``use_te``: TE spec).

    ``fusions``: megatron-core fusion field -> on/off, from ``models.fusions.decide`` (None: all off).
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from megatron_recipes.validation.validate import require

    # the values mapped below
    require(cfg, "model.option_values", "recompute.values", "recompute.modules_values", "model.rope_scaling_mcore")
    m = cfg.model
    fields: Dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=derived.head_dim(m),
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        init_method_std=m.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        window_size=(m.sliding_window - 1, 0) if m.sliding_window else None,  # HF: the last N keys, itself included
        calculate_per_token_loss=True,
        use_cpu_initialization=cpu_init,
        masked_softmax_fusion=False,
        deallocate_pipeline_outputs=True,
        deterministic_mode=cfg.train.deterministic,
    )
    # Fused kernels as models.fusions decided for this machine (all off when not given: conversion).
    fields.update({name: False for name in fusions_off()})
    fields.update(fusions or {})
    fields.update(_ACTIVATIONS[m.activation])
    fields.update(_parallel_fields(cfg, on_gpu=not cpu_init))
    fields.update(_precision_fields(cfg))
    fields.update(_moe_fields(cfg, use_te))
    fields.update(_recompute_fields(cfg))
    fields.update(_offload_fields(cfg))
    if m.multi_latent_attention:
        fields.update(_mla_fields(cfg))
        return _construct(MLATransformerConfig, fields)
    return _construct(TransformerConfig, fields)


def _construct(cls, fields: Dict[str, Any]):
    """Build the config, turning megatron-core's own checks into a RecipeError that keeps its message."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k in fields if k not in known)
    if unknown:  # a field renamed in a newer megatron-core: fail loudly instead of dropping a setting
        raise RecipeError(
            f"megatron-core's {cls.__name__} has no field(s) {unknown}",
            fix="use a supported megatron-core version (see pyproject.toml)",
        )
    try:
        return cls(**fields)
    except (AssertionError, ValueError) as exc:
        raise RecipeError(f"megatron-core rejected the model configuration: {exc}", fix="see the message") from None
