"""The one FLOPs count: training FLOPs per token, the MFU numerator of both ``plan`` and the trainer.

Matrix-multiply FLOPs come from the cost model's parameter counts (``params.py``, checked against what
megatron-core builds): ``2 x`` the weights one token meets (top-k routed experts, the router, shared
experts), causal core attention at half the ``s x s`` square, the logits over the *padded*
vocabulary, and multi-token-prediction layers with their own logits. Forward x3 covers forward +
backward; recomputation is not counted (MFU measures useful work, not hardware work).

Why the padded vocabulary: the output layer really multiplies by ``padded_vocab_size x hidden``
weights, and Megatron-LM (``training.num_floating_point_operations``) and Megatron-Bridge (whose FLOP
count produced NVIDIA's published MFU tables) both count ``padded_vocab_size``; counting the unpadded
one would make our MFU incomparable with those tables.
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config import derived
from megatron_recipes.config.schema import ModelConfig, RunConfig
from megatron_recipes.estimate.params import Shard, attention_params, mlp_params


def _attention_core_flops(m: ModelConfig, seq: int) -> float:
    """Causal QK^T and PV per token, forward: half the s x s square (masked tiles are skipped)."""
    if m.multi_latent_attention:
        d_qk, d_v = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        d_qk = d_v = derived.head_dim(m)
    window = min(seq, m.sliding_window) if m.sliding_window else seq / 2
    return 2.0 * window * m.num_attention_heads * (d_qk + d_v)


def kind_forward_parts(m: ModelConfig, moe: bool, seq: int) -> tuple[float, float, float]:
    """(attention matmul, MLP matmul, core-attention) FLOPs per token of one layer's forward, whole model
    width. The MLP side of an MoE layer is its router, top-k routed experts and shared experts."""
    full = Shard(te_spec=True)
    attn = attention_params(m, full, with_norm=False)
    if moe:
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        mlp = m.num_moe_experts * m.hidden_size + m.moe_router_topk * mlp_params(m, moe_ffn, 1, with_norm=False)
        if m.moe_shared_expert_intermediate_size:
            mlp += mlp_params(m, m.moe_shared_expert_intermediate_size, 1, with_norm=False)
    else:
        mlp = mlp_params(m, m.ffn_hidden_size, 1, with_norm=False)
    return 2.0 * attn, 2.0 * mlp, float(_attention_core_flops(m, seq))


def recomputed_forward_parts(m: ModelConfig, moe: bool, seq: int, modules) -> tuple[float, float]:
    """(matmul, core-attention) FLOPs per token of one layer's forward that selective recompute runs again in
    backward, whole model width: core attention (``core_attn``), the MLA q/kv up-projections (``mla_up_proj``),
    a dense layer's MLP (``mlp``), an MoE layer's router, routed and shared experts (``moe``) or its shared
    experts (``shared_experts``); ``layernorm`` and ``moe_act`` rerun memory-bound kernels only."""
    _, mlp, core = kind_forward_parts(m, moe, seq)
    mm = 0.0
    if "mla_up_proj" in modules and m.multi_latent_attention:
        q_in = m.q_lora_rank or m.hidden_size  # without a q latent the q projection runs inside the checkpoint
        q_out, kv_out = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_head_dim + m.v_head_dim
        mm += 2.0 * m.num_attention_heads * (q_in * q_out + m.kv_lora_rank * kv_out)
    if ("mlp" in modules and not moe) or ("moe" in modules and moe):
        mm += mlp
    elif "shared_experts" in modules and moe and m.moe_shared_expert_intermediate_size:
        mm += 2.0 * mlp_params(m, m.moe_shared_expert_intermediate_size, 1, with_norm=False)
    return mm, (core if "core_attn" in modules else 0.0)


def kind_forward_flops(m: ModelConfig, moe: bool, seq: int) -> tuple[float, float]:
    """(matmul FLOPs, core-attention FLOPs) per token of one layer's forward, whole model width."""
    attn, mlp, core = kind_forward_parts(m, moe, seq)
    return attn + mlp, core


def logits_forward_flops(cfg: RunConfig) -> float:
    """Output layer per token, forward: the padded vocabulary at the run's TP (what megatron-core builds)."""
    return 2.0 * cfg.model.hidden_size * derived.padded_vocab_size(cfg.model, cfg.parallel.tp)


def mtp_forward_flops(cfg: RunConfig) -> float:
    """Multi-token prediction per token, forward: each MTP layer's ``2h -> h`` projection, its transformer
    layer (like the model's last) and its own logits. Counted like Megatron-LM's
    ``num_floating_point_operations``, which produced the published DeepSeek-V3 MFU."""
    m, n = cfg.model, cfg.model.mtp_num_layers or 0
    if not n:
        return 0.0
    layer = sum(kind_forward_flops(m, derived.is_moe_layer(m, m.num_layers - 1), cfg.train.seq_length))
    return n * (2.0 * 2 * m.hidden_size * m.hidden_size + layer + logits_forward_flops(cfg))


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token (forward + backward, no recompute), the MFU numerator."""
    m, s = cfg.model, cfg.train.seq_length
    n_moe = sum(derived.is_moe_layer(m, i) for i in range(m.num_layers))
    fwd = sum(kind_forward_flops(m, False, s)) * (m.num_layers - n_moe)
    if n_moe:
        fwd += sum(kind_forward_flops(m, True, s)) * n_moe
    return 3.0 * (fwd + logits_forward_flops(cfg) + mtp_forward_flops(cfg))


def tokens_per_step(cfg: RunConfig) -> int:
    return cfg.train.global_batch_size * cfg.train.seq_length


def flops_per_step(cfg: RunConfig) -> float:
    return flops_per_token(cfg) * tokens_per_step(cfg)


def mfu(cfg: RunConfig, step_time_s: float) -> Optional[float]:
    """Model FLOPs utilisation over all ranks against the bf16 dense peak; None without a peak (CPU)."""
    peak = cfg.cluster.peak_bf16_tflops * 1e12 * derived.world_size(cfg)
    if peak <= 0 or step_time_s <= 0:
        return None
    return flops_per_step(cfg) / step_time_s / peak
