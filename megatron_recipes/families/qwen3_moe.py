"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention (q/k norm), softmax router over SwiGLU experts."""

import dataclasses

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.families import _moe, llama, qwen3
from megatron_recipes.families.family import TINY
from megatron_recipes.families.hf_config import require

MOE = _moe.routed_experts("mlp.gate.weight", "mlp.experts.{expert}", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _first_dense_layers(hf) -> int:
    """Qwen3-MoE may keep some layers dense (``mlp_only_layers``); megatron here supports a leading block."""
    dense = sorted(getattr(hf, "mlp_only_layers", None) or [])
    if dense != list(range(len(dense))):
        raise RecipeError(f"HF mlp_only_layers={dense} is not a leading block of layers", fix="only layers 0..k-1 may be dense")
    return len(dense)


def config_from_hf(hf):
    require(hf, "decoder_sparse_step", 1, "every layer after the dense block must be MoE")
    return {
        **qwen3.attention_config_from_hf(hf),
        "family": "qwen3_moe",
        "num_moe_experts": hf.num_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_first_dense_layers": _first_dense_layers(hf),
        # HF norm_topk_prob renormalises the top-k of a full softmax == megatron's softmax over top-k logits
        "moe_router_pre_softmax": not bool(hf.norm_topk_prob),
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
    }


def config_to_hf(m):
    return {
        **qwen3.config_to_hf(m),
        "num_experts": m.num_moe_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.moe_first_dense_layers)),
        "norm_topk_prob": not m.moe_router_pre_softmax,
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
    }


def tiny_hf_config(**overrides):
    """GQA, q/k norms with an explicit head_dim, 4 experts, top-2."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY, "num_key_value_heads": 2, "vocab_size": 1000, "moe_intermediate_size": 32, "num_experts": 4,
                             "num_experts_per_tok": 2, "head_dim": 16, **overrides})

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_type="qwen3_moe",
    weights={**llama.EMBEDDINGS, **llama.ATTENTION, **qwen3.QK_NORM, **llama.DENSE_MLP, **MOE},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
