"""Mixtral (``MixtralForCausalLM``): Llama attention, top-k softmax router over SwiGLU experts."""

import dataclasses

from megatron_recipes.families import _moe, llama
from megatron_recipes.families.family import TINY
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, sliding_window_from_hf

MOE = _moe.routed_experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}", "w1.weight", "w3.weight", "w2.weight")


def config_from_hf(hf):
    return {
        **dense_from_hf(hf),
        "family": "mixtral",
        "sliding_window": sliding_window_from_hf(hf),
        "num_moe_experts": hf.num_local_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.intermediate_size,
        "moe_router_pre_softmax": False,  # softmax over the top-k logits == renormalised full softmax
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
    }


def config_to_hf(m):
    return {
        **dense_to_hf(m),
        "intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
        "sliding_window": m.sliding_window,
        "num_local_experts": m.num_moe_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "router_aux_loss_coef": m.moe_aux_loss_coeff,
    }


def tiny_hf_config(**overrides):
    """GQA, 4 experts, top-2."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **{**TINY, "num_key_value_heads": 2, "vocab_size": 1000, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides}
    )

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_type="mixtral",
    weights={**llama.EMBEDDINGS, **llama.ATTENTION, **MOE},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
