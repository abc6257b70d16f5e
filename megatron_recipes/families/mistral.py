"""Mistral (``MistralForCausalLM``): Llama's tensors plus a sliding attention window."""

import dataclasses

from megatron_recipes._conversion import llama
from megatron_recipes.convert.hf_config import dense_from_hf, dense_to_hf, sliding_window_from_hf


def config_from_hf(hf):
    return {**dense_from_hf(hf), "family": "mistral", "sliding_window": sliding_window_from_hf(hf)}


def config_to_hf(m):
    return {**dense_to_hf(m), "sliding_window": m.sliding_window}


FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_type="mistral",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
