"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's tensors plus biases on q/k/v."""

import dataclasses

from megatron_recipes.families import llama
from megatron_recipes.families.family import TINY, hf_layer, layer_table
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, require
from megatron_recipes.families.transforms import QKV

QKV_BIAS = layer_table(
    {
        "self_attention.linear_qkv.bias": QKV(
            hf_layer("self_attn.q_proj.bias"), hf_layer("self_attn.k_proj.bias"), hf_layer("self_attn.v_proj.bias")
        ),
    }
)


def config_from_hf(hf):
    require(hf, "use_sliding_window", False, "per-layer sliding windows are not mapped")
    return {**dense_from_hf(hf), "family": "qwen2", "add_qkv_bias": True}


def config_to_hf(m):
    return {**dense_to_hf(m), "use_sliding_window": False}


def tiny_hf_config(**overrides):
    """GQA, QKV biases and tied embeddings."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True, **overrides})

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_type="qwen2",
    weights={**llama.FAMILY.weights, **QKV_BIAS},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
