"""Mistral (``MistralForCausalLM``): Llama's tensors plus a sliding attention window."""

import dataclasses

from megatron_recipes.families import llama
from megatron_recipes.families.family import TINY
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, sliding_window_from_hf


def config_from_hf(hf):
    return {**dense_from_hf(hf), "family": "mistral", "sliding_window": sliding_window_from_hf(hf)}


def config_to_hf(m):
    return {**dense_to_hf(m), "sliding_window": m.sliding_window}


def tiny_hf_config(**overrides):
    """GQA and a sliding window shorter than the test prompt."""
    from transformers import MistralConfig

    return MistralConfig(**{**TINY, "num_key_value_heads": 2, "vocab_size": 1100, "sliding_window": 5, **overrides})

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_type="mistral",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
