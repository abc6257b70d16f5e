"""Llama 2 / 3 / 3.1 (``LlamaForCausalLM``, llama3 RoPE scaling included): the dense core others reuse."""

from megatron_recipes.families.family import TINY, Family, hf_layer, layer_table
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, require
from megatron_recipes.families.transforms import QKV, Copy, Gated, Vocab

EMBEDDINGS = {
    "embedding.word_embeddings.weight": Vocab("model.embed_tokens.weight"),
    "output_layer.weight": Vocab("lm_head.weight"),  # absent from megatron's state when embeddings are tied
    "decoder.final_layernorm.weight": Copy("model.norm.weight"),
}

ATTENTION = layer_table(
    {
        "self_attention.linear_qkv.layer_norm_weight": Copy(hf_layer("input_layernorm.weight")),
        "self_attention.linear_qkv.weight": QKV(
            hf_layer("self_attn.q_proj.weight"), hf_layer("self_attn.k_proj.weight"), hf_layer("self_attn.v_proj.weight")
        ),
        "self_attention.linear_proj.weight": Copy(hf_layer("self_attn.o_proj.weight")),
    }
)

DENSE_MLP = layer_table(
    {
        "mlp.linear_fc1.layer_norm_weight": Copy(hf_layer("post_attention_layernorm.weight")),
        "mlp.linear_fc1.weight": Gated(hf_layer("mlp.gate_proj.weight"), hf_layer("mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": Copy(hf_layer("mlp.down_proj.weight")),
    }
)


def config_from_hf(hf):
    require(hf, "attention_bias", False, "megatron-core's add_qkv_bias does not bias o_proj")
    require(hf, "mlp_bias", False, "bias-free MLPs only")
    require(hf, "pretraining_tp", 1, "sliced pretraining TP changes the math")
    return {**dense_from_hf(hf), "family": "llama"}


def config_to_hf(m):
    return {**dense_to_hf(m), "attention_bias": False, "mlp_bias": False}


def tiny_hf_config(**overrides):
    """GQA (2 query groups under 4 heads) and llama3 RoPE scaling; the vocabulary forces padding."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(**{**TINY, "num_key_value_heads": 2, "vocab_size": 1000, "rope_parameters": rope, **overrides})


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    weights={**EMBEDDINGS, **ATTENTION, **DENSE_MLP},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tiny_hf_config=tiny_hf_config,
)
