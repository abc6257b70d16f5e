"""Megatron-LM's ``args`` (the ``argparse.Namespace`` its ``common.pt`` carries) <-> this project's model and
layout, both ways.

Why both ways: users arrive with Megatron-LM checkpoints (the model is described only by the training
command's arguments, saved as ``args``), and Megatron-LM's ``load_checkpoint`` reads ``args``,
``checkpoint_version`` and ``iteration`` from a checkpoint before it loads a tensor. Names follow
Megatron-LM's ``arguments.py`` (read at core_v0.16.1 and main); the tensors themselves need no mapping,
both sides save megatron-core's ``sharded_state_dict`` under ``model``/``model{i}``.

A setting our ``ModelConfig`` cannot express is refused naming the Megatron-LM argument: loading weights
into a model that differs from the one they were trained in gives plausible, wrong logits.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Tuple

from megatron_recipes.config.errors import RecipeError

CHECKPOINT_VERSION = 3.0  # what Megatron-LM's generate_state_dict writes (and its loader expects)
# ModelConfig fields with the same name and meaning as Megatron-LM's argument
_SAME = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "normalization", "add_bias_linear",
         "add_qkv_bias", "qk_layernorm", "init_method_std", "make_vocab_size_divisible_by", "position_embedding_type",
         "rotary_percent", "max_position_embeddings", "mtp_num_layers",
         "mtp_loss_scaling_factor")
_MOE_SAME = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_num_groups", "moe_router_group_topk",
             "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "moe_router_load_balancing_type",
             "moe_aux_loss_coeff")
_MLA_SAME = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_YARN = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings")

# Megatron-LM arguments that change what a layer computes and that this project's model cannot express:
# (argument, the value that is fine, what it means)
_UNSUPPORTED = (
    ("apply_layernorm_1p", False, "zero-centred norm weights (weight + 1)"),
    ("layernorm_zero_centered_gamma", False, "zero-centred norm weights (weight + 1)"),
    ("apply_residual_connection_post_layernorm", False, "the residual taken after the norm"),
    ("rotary_interleaved", False, "interleaved rotary embedding"),
    ("heterogeneous_layers_config_path", None, "heterogeneous layers (a different block per layer)"),
    ("qk_l2_norm", False, "L2-normalised queries and keys"),
    ("moe_shared_expert_gate", False, "a gated shared expert"),
    ("rotary_seq_len_interpolation_factor", None, "rotary position interpolation"),
    ("quick_geglu", False, "the quick-GeGLU activation"),
    ("mrope_section", None, "multimodal rotary embedding"),
    ("moe_use_legacy_grouped_gemm", False, "the legacy grouped-GEMM expert weights"),
)
_ARGUMENT_FIX = ("train it with this project's recipe from the HF model instead (convert import), or convert it "
                 "with a tool that models this feature")


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _refuse(where: str, argument: str, value: Any, why: str) -> RecipeError:
    return RecipeError(
        f"'{where}' is a Megatron-LM checkpoint this project cannot express: --{argument.replace('_', '-')} = "
        f"{value!r} ({why}) has no counterpart in model.* here", fix=_ARGUMENT_FIX)


def _activation(args: Any, where: str) -> str:
    if _arg(args, "swiglu"):
        return "swiglu"
    if _arg(args, "squared_relu"):
        return "squared_relu"
    if _arg(args, "gated_linear_unit"):
        raise _refuse(where, "gated_linear_unit", True, "a gated unit other than SwiGLU")
    return "gelu"


def _rope_scaling(args: Any, where: str) -> Optional[Dict[str, Any]]:
    if _arg(args, "multi_latent_attention") and _arg(args, "rope_type") == "yarn":
        out = {"rope_type": "yarn", "factor": float(_arg(args, "rotary_scaling_factor", 1.0))}
        out.update({k: _arg(args, k) for k in _YARN if _arg(args, k) is not None})
        return out
    if _arg(args, "use_rope_scaling"):  # megatron-core's apply_rope_scaling: Llama 3.1's, fixed frequency factors
        return {"rope_type": "llama3", "factor": float(_arg(args, "rope_scaling_factor", 8.0)),
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    if _arg(args, "rope_type") not in (None, "rope") and _arg(args, "multi_latent_attention"):
        raise _refuse(where, "rope_type", _arg(args, "rope_type"), "a rotary variant other than rope/yarn")
    return None


def _moe_first_dense_layers(args: Any, where: str) -> int:
    """megatron-core's ``moe_layer_freq`` (an int k: every k-th layer; a list: 1 = MoE) as the only pattern
    ``ModelConfig`` has: the first N layers dense, the rest MoE."""
    freq, n = _arg(args, "moe_layer_freq", 1), int(args.num_layers)
    pattern = [int(i % freq == 0) for i in range(n)] if isinstance(freq, int) else [int(x) for x in freq]
    dense = next((i for i, moe in enumerate(pattern) if moe), n)
    if len(pattern) != n or any(not moe for moe in pattern[dense:]):
        raise _refuse(where, "moe_layer_freq", freq, "MoE layers other than 'all after the first N dense ones'")
    return dense


def model_fields(args: Any, where: str) -> Dict[str, Any]:
    """The ``ModelConfig`` fields ``args`` describe (no name/family: the caller labels them)."""
    for argument, fine, why in _UNSUPPORTED:
        value = _arg(args, argument, fine)
        if (value is not None) if fine is None else bool(value):
            raise _refuse(where, argument, value, why)
    if _arg(args, "normalization") not in ("RMSNorm", "LayerNorm"):
        raise _refuse(where, "normalization", _arg(args, "normalization"), "a norm other than RMSNorm/LayerNorm")
    if _arg(args, "position_embedding_type") not in ("rope", "learned_absolute", "none"):
        raise _refuse(where, "position_embedding_type", _arg(args, "position_embedding_type"), "another position embedding")
    fields: Dict[str, Any] = {name: _arg(args, name) for name in _SAME if _arg(args, name) is not None}  # else defaults
    heads = int(args.num_attention_heads)
    fields["num_query_groups"] = int(args.num_query_groups) if _arg(args, "group_query_attention") else heads
    fields["vocab_size"] = vocab_size(args) or int(args.padded_vocab_size)  # unknown: the rows it holds
    kv = _arg(args, "kv_channels")
    fields["kv_channels"] = None if kv in (None, args.hidden_size // heads) else int(kv)
    fields["norm_epsilon"] = float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5)))
    fields["activation"] = _activation(args, where)
    fields["rotary_base"] = float(_arg(args, "rotary_base", 10000))
    fields["rope_scaling"] = _rope_scaling(args, where)
    fields["tie_embeddings"] = not _arg(args, "untie_embeddings_and_output_weights", False)
    window = _arg(args, "window_size")
    if window is not None:
        if len(window) != 2 or int(window[1]) != 0 or int(window[0]) < 0:
            raise _refuse(where, "window_size", window, "attention to keys ahead of the query")
        fields["sliding_window"] = int(window[0]) + 1  # megatron-core's (left, 0): the last left+1 keys
    if _arg(args, "num_experts"):
        fields["num_moe_experts"] = int(args.num_experts)
        fields.update({name: _arg(args, name) for name in _MOE_SAME if _arg(args, name) is not None})
        fields["moe_first_dense_layers"] = _moe_first_dense_layers(args, where)
    if _arg(args, "multi_latent_attention"):
        fields["multi_latent_attention"] = True
        fields.update({name: _arg(args, name) for name in _MLA_SAME})
    return fields


def vocab_size(args: Any) -> Optional[int]:
    """The tokenizer's vocabulary, where ``args`` say it: Megatron-LM's NullTokenizer adds an end-of-document
    token to ``--vocab-size``; with a real tokenizer the argument is unset (its size came from the tokenizer),
    and only the padded row count is known."""
    size = _arg(args, "vocab_size")
    if size is None:
        return None
    return int(size) + 1 if _arg(args, "tokenizer_type") == "NullTokenizer" else int(size)


def layout(args: Any) -> Dict[str, Any]:
    """The parallel layout the checkpoint was saved with, in ``_identity.layout``'s terms."""
    tp = int(_arg(args, "tensor_model_parallel_size", 1))
    return {
        "tp": tp,
        "pp": int(_arg(args, "pipeline_model_parallel_size", 1)),
        "vpp": _arg(args, "virtual_pipeline_model_parallel_size"),
        "cp": int(_arg(args, "context_parallel_size", 1)),
        "ep": int(_arg(args, "expert_model_parallel_size", 1)),
        "etp": int(_arg(args, "expert_tensor_parallel_size") or tp),
        "sp": bool(_arg(args, "sequence_parallel", False)),
        "dp": int(_arg(args, "data_parallel_size", 1)),
        "world_size": int(_arg(args, "world_size", 1)),
        "num_layers_in_first_pipeline_stage": _arg(args, "decoder_first_pipeline_num_layers"),
        "num_layers_in_last_pipeline_stage": _arg(args, "decoder_last_pipeline_num_layers"),
        "account_for_embedding_in_pipeline_split": bool(_arg(args, "account_for_embedding_in_pipeline_split", False)),
        "account_for_loss_in_pipeline_split": bool(_arg(args, "account_for_loss_in_pipeline_split", False)),
        "pipeline_layout": _layout_string(_arg(args, "pipeline_model_parallel_layout")),
        "make_vocab_size_divisible_by": int(_arg(args, "make_vocab_size_divisible_by", 128)),
        "padded_vocab_size": _arg(args, "padded_vocab_size"),
    }


def _layout_string(value: Any) -> Optional[str]:
    """Megatron-LM keeps the layout as given (a string) or parsed (its PipelineParallelLayerLayout's repr is
    the string it was built from)."""
    return None if value is None else str(value)


def family_of(fields: Dict[str, Any]) -> str:
    """The family whose HF mapping fits these features (an export needs one; the label is not checked)."""
    if fields.get("num_moe_experts"):
        if fields.get("multi_latent_attention"):
            return "deepseek_v3"
        return "qwen3_moe" if fields.get("qk_layernorm") else "mixtral"
    if fields.get("qk_layernorm"):
        return "qwen3"
    if fields.get("add_qkv_bias"):
        return "qwen2"
    return "mistral" if fields.get("sliding_window") else "llama"


# --- this project's checkpoints, described as Megatron-LM's load_checkpoint reads them ---


def _inverse_model(m) -> Dict[str, Any]:
    from megatron_recipes.config import derived

    out: Dict[str, Any] = {name: getattr(m, name) for name in _SAME}
    out.update(
        vocab_size=m.vocab_size,
        group_query_attention=m.num_query_groups != m.num_attention_heads, num_query_groups=m.num_query_groups,
        kv_channels=derived.head_dim(m), norm_epsilon=m.norm_epsilon, layernorm_epsilon=m.norm_epsilon,
        swiglu=m.activation == "swiglu", squared_relu=m.activation == "squared_relu", rotary_base=m.rotary_base,
        untie_embeddings_and_output_weights=not m.tie_embeddings,
        window_size=(m.sliding_window - 1, 0) if m.sliding_window else None, num_experts=m.num_moe_experts,
        multi_latent_attention=m.multi_latent_attention, use_rotary_position_embeddings=m.position_embedding_type == "rope",
    )
    rs = m.rope_scaling
    out.update(use_rope_scaling=rs is not None and rs.rope_type == "llama3",
               rope_scaling_factor=rs.factor if rs is not None and rs.rope_type == "llama3" else 8.0)
    if m.multi_latent_attention:
        out.update({name: getattr(m, name) for name in _MLA_SAME})
        out["rope_type"] = "yarn" if rs is not None else "rope"
        if rs is not None:
            out["rotary_scaling_factor"] = rs.factor
            out.update({k: getattr(rs, k) for k in _YARN})
    if m.num_moe_experts:
        out.update({name: getattr(m, name) for name in _MOE_SAME})
        out["moe_ffn_hidden_size"] = m.moe_ffn_hidden_size or m.ffn_hidden_size
        out["moe_layer_freq"] = derived.moe_layer_pattern(m)
    return out


def args_for(cfg, consumed_samples: int, optimizer_format: Optional[str], has_optimizer: bool) -> argparse.Namespace:
    """The ``args`` a checkpoint of ``cfg`` carries for Megatron-LM: its model, layout and progress. Plain
    values only (Megatron-LM's own hold enums and dtypes; ours need nothing a restricted load refuses).
    ``no_save_rng``: our RNG record is one object per rank, not Megatron-LM's (pp, tp) grid."""
    from megatron_recipes.config import derived

    p = cfg.parallel
    lay = {
        "tensor_model_parallel_size": p.tp, "pipeline_model_parallel_size": p.pp,
        "virtual_pipeline_model_parallel_size": p.vpp, "context_parallel_size": p.cp,
        "expert_model_parallel_size": p.ep, "expert_tensor_parallel_size": derived.expert_tensor_parallel_size(cfg),
        "sequence_parallel": p.sp, "data_parallel_size": derived.data_parallel_size(cfg),
        "world_size": derived.world_size(cfg),
        "decoder_first_pipeline_num_layers": p.num_layers_in_first_pipeline_stage,
        "decoder_last_pipeline_num_layers": p.num_layers_in_last_pipeline_stage,
        "account_for_embedding_in_pipeline_split": p.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": p.account_for_loss_in_pipeline_split,
        "pipeline_model_parallel_layout": p.pipeline_layout,
        "padded_vocab_size": derived.padded_vocab_size(cfg.model, p.tp),
    }
    progress = {
        "consumed_train_samples": int(consumed_samples), "skipped_train_samples": 0, "consumed_valid_samples": 0,
        "global_batch_size": cfg.train.global_batch_size, "micro_batch_size": cfg.train.micro_batch_size,
        "seq_length": cfg.train.seq_length, "train_iters": cfg.train.train_iters,
        "ckpt_format": "torch_dist", "use_distributed_optimizer": optimizer_format is not None,
        "dist_ckpt_optim_fully_reshardable": optimizer_format == "fully_reshardable",
        "no_save_optim": not has_optimizer, "no_save_rng": True, "optimizer": cfg.optimizer.name,
        "bf16": cfg.precision.params_dtype == "bf16", "fp16": cfg.precision.params_dtype == "fp16",
    }
    return argparse.Namespace(**_inverse_model(cfg.model), **lay, **progress)


SCHEDULE_STEPS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def scheduler_in_samples(state: Dict[str, Any], global_batch_size: int) -> Dict[str, Any]:
    """Our scheduler counts optimizer steps; Megatron-LM's counts samples (it steps by the global batch)."""
    return {k: (v * global_batch_size if k in SCHEDULE_STEPS else v) for k, v in state.items()}


def scheduler_in_steps(state: Dict[str, Any], args: Any, where: str) -> Dict[str, Any]:
    if _arg(args, "rampup_batch_size"):
        raise RecipeError(
            f"'{where}' was trained with --rampup-batch-size {args.rampup_batch_size}: its LR schedule counts samples "
            "at a changing batch size, which this project's step-counted schedule cannot continue",
            fix=f"start from its weights with checkpoint.pretrained={where} checkpoint.load=none")
    gbs = int(args.global_batch_size)
    return {k: (v // gbs if k in SCHEDULE_STEPS else v) for k, v in state.items()}


def common_keys(cfg, step: int, consumed_samples: int, optimizer_format: Optional[str], has_optimizer: bool,
                scheduler_state: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What Megatron-LM's ``load_checkpoint`` reads from the common state besides tensors."""
    out: Dict[str, Any] = {
        "args": args_for(cfg, consumed_samples, optimizer_format, has_optimizer),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(step),
    }
    if scheduler_state is not None:
        out["opt_param_scheduler"] = scheduler_in_samples(scheduler_state, cfg.train.global_batch_size)
    return out


def progress(args: Any, common: Dict[str, Any]) -> Tuple[int, int]:
    """(iteration, consumed samples) of a Megatron-LM checkpoint."""
    step = int(common.get("iteration", 0))
    return step, int(_arg(args, "consumed_train_samples", step * int(_arg(args, "global_batch_size", 0) or 0)))

