"""Llama 2 / 3 / 3.1 (``LlamaForCausalLM``, llama3 RoPE scaling included): the dense core others reuse."""

from megatron_recipes.convert.family import Family, hf_layer, layer_table
from megatron_recipes.convert.hf_config import dense_from_hf, dense_to_hf, require
from megatron_recipes.convert.transforms import QKV, Copy, Gated, Vocab

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


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_type="llama",
    weights={**EMBEDDINGS, **ATTENTION, **DENSE_MLP},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
