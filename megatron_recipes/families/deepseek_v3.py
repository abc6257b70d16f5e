"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention, first layers dense, then sigmoid-routed
experts with a shared expert and a routing bias, and ``num_nextn_predict_layers`` multi-token-prediction layers.

MTP layers are stored after the decoder layers (``model.layers.61.*`` after 61; transformers ignores them):
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (megatron-core's ``final_layernorm``), a decoder layer
under the same index (mapped by the decoder's table, MLA and MoE alike), and copies of the model's embedding
and output head (``embed_tokens``, ``shared_head.head``), which megatron-core's MTP layers share with the
model: import requires them equal to the model's, export writes them back. ``eh_proj`` takes
``[enorm(embedding); hnorm(hidden)]`` in both: megatron-core concatenates in that order, and so do the
servers that run DeepSeek-V3's released MTP weights (the report's formula writes the two the other way).

megatron-core's MLA keeps the RoPE channels of the q and k-rope projections interleaved, as HF's default
``rope_interleave: true`` does; a model stored with ``rope_interleave: false`` is permuted once on import
(``RopeRows``), its MTP layer's attention included.
"""

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.families import _moe, llama
from megatron_recipes.families.family import TINY, Family, hf_layer, layer_table, mtp_layer_table
from megatron_recipes.families.hf_config import dense_from_hf, dense_to_hf, require
from megatron_recipes.families.transforms import Copy, Gated, RopeRows, Vocab


def _q_block(m):
    return m.qk_head_dim + m.qk_pos_emb_head_dim


def _rope(m):
    return m.qk_pos_emb_head_dim


MLA = layer_table(
    {
        "input_layernorm.weight": Copy(hf_layer("input_layernorm.weight")),
        "self_attention.linear_q_proj.weight": RopeRows(hf_layer("self_attn.q_proj.weight"), _q_block, _rope),
        "self_attention.linear_q_down_proj.weight": Copy(hf_layer("self_attn.q_a_proj.weight")),
        "self_attention.linear_q_up_proj.layer_norm_weight": Copy(hf_layer("self_attn.q_a_layernorm.weight")),
        "self_attention.linear_q_up_proj.weight": RopeRows(hf_layer("self_attn.q_b_proj.weight"), _q_block, _rope),
        "self_attention.linear_kv_down_proj.weight": RopeRows(
            hf_layer("self_attn.kv_a_proj_with_mqa.weight"), lambda m: m.kv_lora_rank + m.qk_pos_emb_head_dim, _rope
        ),
        "self_attention.linear_kv_up_proj.layer_norm_weight": Copy(hf_layer("self_attn.kv_a_layernorm.weight")),
        "self_attention.linear_kv_up_proj.weight": Copy(hf_layer("self_attn.kv_b_proj.weight")),
        "self_attention.linear_proj.weight": Copy(hf_layer("self_attn.o_proj.weight")),
    }
)

MOE = {
    **_moe.routed_experts("mlp.gate.weight", "mlp.experts.{expert}", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    **layer_table(
        {
            "mlp.router.expert_bias": Copy(hf_layer("mlp.gate.e_score_correction_bias")),
            "mlp.shared_experts.linear_fc1.weight": Gated(
                hf_layer("mlp.shared_experts.gate_proj.weight"), hf_layer("mlp.shared_experts.up_proj.weight")
            ),
            "mlp.shared_experts.linear_fc2.weight": Copy(hf_layer("mlp.shared_experts.down_proj.weight")),
        }
    ),
}


# The model's embedding and output head, stored once more under each MTP layer
EMBEDDINGS = {
    **llama.EMBEDDINGS,
    "embedding.word_embeddings.weight": Vocab("model.embed_tokens.weight", per_mtp_layer=hf_layer("embed_tokens.weight")),
    "output_layer.weight": Vocab("lm_head.weight", per_mtp_layer=hf_layer("shared_head.head.weight")),
}

MTP = mtp_layer_table(
    {**MLA, **llama.DENSE_MLP, **MOE},
    {
        "enorm.weight": Copy(hf_layer("enorm.weight")),
        "hnorm.weight": Copy(hf_layer("hnorm.weight")),
        "eh_proj.weight": Copy(hf_layer("eh_proj.weight")),
        "final_layernorm.weight": Copy(hf_layer("shared_head.norm.weight")),
    },
)


def config_from_hf(hf):
    require(hf, "norm_topk_prob", True, "megatron-core normalises the top-k sigmoid scores")
    require(hf, "moe_layer_freq", 1, "every layer after the first dense ones must be MoE")
    require(hf, "attention_bias", False, "MLA projections are bias-free")
    topk, groups, group_topk = hf.num_experts_per_tok, hf.n_group, hf.topk_group
    if groups and group_topk and topk // group_topk != 2:
        raise RecipeError(
            f"HF num_experts_per_tok={topk} / topk_group={group_topk} != 2: HF scores groups by their top-2 experts, "
            "megatron-core by their top-(topk/group_topk)",
            fix="only configurations with num_experts_per_tok == 2 * topk_group convert exactly",
        )
    out = dense_from_hf(hf)
    out.update(
        family="deepseek_v3",
        num_query_groups=hf.num_attention_heads,
        kv_channels=None,
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_head_dim=hf.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        num_moe_experts=hf.n_routed_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(hf.n_shared_experts or 0) * hf.moe_intermediate_size or None,
        moe_first_dense_layers=hf.first_k_dense_replace,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4,
        mtp_num_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0) or None,
        mtp_loss_scaling_factor=0.1,  # not in config.json: DeepSeek-V3's value at the end of pretraining (recipes/model)
    )
    return out


def config_to_hf(m):
    out = dense_to_hf(m)
    out.update(
        num_key_value_heads=m.num_attention_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_head_dim,
        qk_rope_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        n_routed_experts=m.num_moe_experts,
        num_experts_per_tok=m.moe_router_topk,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        n_shared_experts=(m.moe_shared_expert_intermediate_size or 0) // (m.moe_ffn_hidden_size or 1),
        first_k_dense_replace=m.moe_first_dense_layers,
        n_group=m.moe_router_num_groups,
        topk_group=m.moe_router_group_topk,
        routed_scaling_factor=m.moe_router_topk_scaling_factor,
        norm_topk_prob=True,
        num_nextn_predict_layers=m.mtp_num_layers or 0,
    )
    return out


def tiny_hf_config(**overrides):
    """MLA with YaRN, a dense first layer, 4 sigmoid-routed experts in 2 groups, a shared expert and one MTP layer."""
    from transformers import DeepseekV3Config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV3Config(**{
        **TINY, "vocab_size": 1000, "num_key_value_heads": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "rope_parameters": yarn, "num_nextn_predict_layers": 1, **overrides,
    })


FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_type="deepseek_v3",
    weights={**EMBEDDINGS, **MLA, **llama.DENSE_MLP, **MOE, **MTP},
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    flags_from_hf=lambda hf: {"rope_interleave": bool(getattr(hf, "rope_interleave", True))},
    tiny_hf_config=tiny_hf_config,
)
