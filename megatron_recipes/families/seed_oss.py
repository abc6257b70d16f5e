"""Seed-OSS (``SeedOssForCausalLM``): Qwen2's tensors (biases on q/k/v, none on o_proj) with an explicit head_dim."""

import dataclasses

from megatron_recipes.families import qwen2
from megatron_recipes.families.family import TINY
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, require


def config_from_hf(hf):
    require(hf, "attention_bias", True, "the q/k/v biases are mapped")
    require(hf, "attention_out_bias", False, "megatron-core's add_qkv_bias does not bias o_proj")
    require(hf, "mlp_bias", False, "bias-free MLPs only")
    return {**dense_from_hf(hf), "family": "seed_oss", "add_qkv_bias": True}


def config_to_hf(m):
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads  # Seed-OSS defaults it to 128
    return {**dense_to_hf(m), "head_dim": head_dim, "attention_bias": True, "attention_out_bias": False, "mlp_bias": False}


def tiny_hf_config(**overrides):
    """GQA and QKV biases."""
    from transformers import SeedOssConfig

    return SeedOssConfig(**{**TINY, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, **overrides})


FAMILY = dataclasses.replace(
    qwen2.FAMILY,
    name="seed_oss",
    architectures=("SeedOssForCausalLM",),
    model_type="seed_oss",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
