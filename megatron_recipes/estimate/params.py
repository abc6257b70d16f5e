"""Exact parameter counts per rank, module by module as megatron-core's GPTModel builds them.

The counts mirror the shapes megatron-core allocates (fused QKV of ``(heads + 2 * query_groups) * head_dim``
rows, gated FC1 of ``2 * ffn`` rows, vocab padded to ``make_vocab_size_divisible_by * TP``, router
``experts x hidden``, per-rank expert slices), so tests can require equality with a built model.
Dense and routed-expert parameters are kept apart: the distributed optimizer shards them over
different groups (DP x CP vs expert-DP).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_recipes.config import derived
from megatron_recipes.config.schema import ModelConfig, RunConfig


@dataclass(frozen=True)
class ParamCount:
    dense: int = 0  # replicated over DP x CP (sharded there by the distributed optimizer)
    expert: int = 0  # routed experts, replicated over expert-DP

    @property
    def total(self) -> int:
        return self.dense + self.expert

    def __add__(self, other: "ParamCount") -> "ParamCount":
        return ParamCount(self.dense + other.dense, self.expert + other.expert)

    def times(self, n: int) -> "ParamCount":
        return ParamCount(self.dense * n, self.expert * n)


@dataclass(frozen=True)
class Shard:
    """How one rank slices the model: TP for dense weights, ETP x EP for experts."""

    tp: int = 1
    etp: int = 1
    ep: int = 1
    te_spec: bool = True  # TE duplicates MLA down-projections over TP; the local spec splits them


def layer_spec_uses_te(cfg: RunConfig) -> bool:
    """GPU clusters run the Transformer Engine spec, the CPU lane megatron-core's local spec."""
    return cfg.cluster.gpu_arch != "cpu"


def shard_of(cfg: RunConfig) -> Shard:
    p = cfg.parallel
    return Shard(p.tp, derived.expert_tensor_parallel_size(cfg), p.ep, layer_spec_uses_te(cfg))


def norm_params(m: ModelConfig, size: int) -> int:
    return size * (2 if m.normalization == "LayerNorm" else 1)


def is_gated(m: ModelConfig) -> bool:
    return m.activation == "swiglu"


def attention_params(m: ModelConfig, s: Shard, with_norm: bool = True) -> int:
    """Self-attention incl. its input norm (TE fuses that norm into the QKV linear: same count)."""
    h, heads, tp = m.hidden_size, m.num_attention_heads, s.tp
    n = norm_params(m, h) if with_norm else 0
    if m.multi_latent_attention:
        q_head = (m.qk_head_dim or 0) + (m.qk_pos_emb_head_dim or 0)
        down_split = 1 if s.te_spec else tp
        latent_norm = norm_params if m.qk_layernorm else (lambda _m, _n: 0)  # megatron: qk_layernorm = latent norms
        if m.q_lora_rank:
            n += h * m.q_lora_rank // down_split + latent_norm(m, m.q_lora_rank)
            n += m.q_lora_rank * heads * q_head // tp
        else:
            n += h * heads * q_head // tp
        n += h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) // down_split + latent_norm(m, m.kv_lora_rank)
        n += m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim) // tp
        n += heads * m.v_head_dim // tp * h
    else:
        d = derived.head_dim(m)
        qkv = (heads + 2 * m.num_query_groups) * d
        n += qkv // tp * h + (qkv // tp if (m.add_bias_linear or m.add_qkv_bias) else 0)
        n += 2 * norm_params(m, d) if m.qk_layernorm else 0
        n += heads * d // tp * h
    n += h if m.add_bias_linear else 0
    return n


def mlp_params(m: ModelConfig, ffn: int, tp: int, with_norm: bool = True) -> int:
    """A (gated) MLP split over ``tp``; FC2's bias is not split (row-parallel)."""
    h, fc1 = m.hidden_size, ffn * (2 if is_gated(m) else 1)
    n = fc1 // tp * h + ffn // tp * h
    if m.add_bias_linear:
        n += fc1 // tp + h
    return n + (norm_params(m, h) if with_norm else 0)


def moe_params(m: ModelConfig, s: Shard) -> ParamCount:
    """Pre-MLP norm + router + shared experts (dense) and this rank's routed experts."""
    h, experts = m.hidden_size, m.num_moe_experts
    dense = norm_params(m, h) + experts * h + (experts if m.add_bias_linear else 0)
    if m.moe_shared_expert_intermediate_size:
        dense += mlp_params(m, m.moe_shared_expert_intermediate_size, s.tp, with_norm=False)
    moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    expert = experts // s.ep * mlp_params(m, moe_ffn, s.etp, with_norm=False)
    return ParamCount(dense, expert)


def layer_params(m: ModelConfig, layer: int, s: Shard) -> ParamCount:
    return kind_params(m, derived.is_moe_layer(m, layer), s)


def kind_params(m: ModelConfig, moe: bool, s: Shard) -> ParamCount:
    """One transformer layer: attention + (MoE block | dense MLP). All layers of a kind are alike."""
    attn = ParamCount(attention_params(m, s))
    if moe:
        return attn + moe_params(m, s)
    return attn + ParamCount(mlp_params(m, m.ffn_hidden_size, s.tp))


def layers_params(m: ModelConfig, layers, s: Shard) -> ParamCount:
    """Sum over global layer indices, one count per kind."""
    n_moe = sum(derived.is_moe_layer(m, i) for i in layers)
    dense = kind_params(m, False, s).times(len(layers) - n_moe) if len(layers) > n_moe else ParamCount()
    return dense + (kind_params(m, True, s).times(n_moe) if n_moe else ParamCount())


def embedding_params(m: ModelConfig, s: Shard) -> int:
    n = derived.padded_vocab_size(m, s.tp) // s.tp * m.hidden_size
    return n + (m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0)


def output_layer_params(m: ModelConfig, s: Shard) -> int:
    return derived.padded_vocab_size(m, s.tp) // s.tp * m.hidden_size


def mtp_params(m: ModelConfig, s: Shard) -> ParamCount:
    """Multi-token-prediction layers (last stage): two norms, the 2h->h projection, a layer, a norm."""
    if not m.mtp_num_layers:
        return ParamCount()
    per = ParamCount(3 * norm_params(m, m.hidden_size) + 2 * m.hidden_size * m.hidden_size // s.tp)
    return (per + layer_params(m, m.num_layers - 1, s)).times(m.mtp_num_layers)


def stage_params(cfg: RunConfig, pp_rank: int, s: Shard | None = None) -> ParamCount:
    """Parameters held by one rank of pipeline stage ``pp_rank`` (all its virtual chunks)."""
    m, s = cfg.model, s or shard_of(cfg)
    pp = max(1, cfg.parallel.pp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    count = layers_params(m, derived.layers_on_pipeline_rank(cfg, pp_rank), s)
    mtp_here = pp_rank == derived.mtp_pipeline_rank(cfg)  # the MTP layers use the embedding too
    if first or mtp_here:
        count = count + ParamCount(embedding_params(m, s))
    if mtp_here:
        count = count + mtp_params(m, s)
    if last:
        count = count + ParamCount(norm_params(m, m.hidden_size))
        if not (m.tie_embeddings and first):  # tied + one stage: the embedding is the output layer
            count = count + ParamCount(output_layer_params(m, s))
    return count


def model_params(cfg: RunConfig) -> ParamCount:
    """The whole model, unsharded (vocab padded as at TP=1)."""
    m, s = cfg.model, Shard(te_spec=layer_spec_uses_te(cfg))
    count = ParamCount(embedding_params(m, s) + norm_params(m, m.hidden_size))
    if not m.tie_embeddings:
        count = count + ParamCount(output_layer_params(m, s))
    return count + layers_params(m, range(m.num_layers), s) + mtp_params(m, s)


def active_params(cfg: RunConfig) -> int:
    """Parameters one token passes through (top-k of the routed experts)."""
    total = model_params(cfg)
    m = cfg.model
    if not derived.is_moe(m):
        return total.total
    return total.dense + total.expert * m.moe_router_topk // m.num_moe_experts
