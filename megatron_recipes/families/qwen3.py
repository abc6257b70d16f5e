"""Qwen3 dense (``Qwen3ForCausalLM``): Llama's tensors plus per-head RMSNorm on queries and keys."""

import dataclasses

from megatron_recipes.families import llama
from megatron_recipes.families.family import TINY, hf_layer, layer_table
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, require
from megatron_recipes.families.transforms import Copy

QK_NORM = layer_table(
    {
        "self_attention.q_layernorm.weight": Copy(hf_layer("self_attn.q_norm.weight")),
        "self_attention.k_layernorm.weight": Copy(hf_layer("self_attn.k_norm.weight")),
    }
)


def attention_config_from_hf(hf):
    require(hf, "attention_bias", False, "Qwen3 attention is bias-free")
    require(hf, "use_sliding_window", False, "per-layer sliding windows are not mapped")
    return {**dense_from_hf(hf), "qk_layernorm": True}


def config_to_hf(m):
    return {**dense_to_hf(m), "attention_bias": False, "use_sliding_window": False}


def tiny_hf_config(**overrides):
    """GQA, q/k norms and an explicit head_dim (not hidden / heads)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY, "num_key_value_heads": 2, "vocab_size": 1000, "head_dim": 32, **overrides})

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_type="qwen3",
    weights={**llama.FAMILY.weights, **QK_NORM},
    config_from_hf=lambda hf: {**attention_config_from_hf(hf), "family": "qwen3"},
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
