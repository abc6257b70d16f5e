"""The one FLOPs count: training FLOPs per token, the MFU numerator of both ``plan`` and the trainer.

Matrix-multiply FLOPs come from the cost model's parameter counts (``params.py``, checked against what
megatron-core builds): ``2 x`` the weights one token meets (top-k routed experts, the router, shared
experts), causal core attention at half the ``s x s`` square, and the logits over the *padded*
vocabulary. Forward x3 covers forward + backward; recomputation is not counted (MFU measures useful
work, not hardware work).

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


def kind_forward_flops(m: ModelConfig, moe: bool, seq: int) -> tuple[float, float]:
    """(matmul FLOPs, core-attention FLOPs) per token of one layer's forward, whole model width."""
    full = Shard(te_spec=True)
    attn = attention_params(m, full, with_norm=False)
    if moe:
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        mlp = m.num_moe_experts * m.hidden_size + m.moe_router_topk * mlp_params(m, moe_ffn, 1, with_norm=False)
        if m.moe_shared_expert_intermediate_size:
            mlp += mlp_params(m, m.moe_shared_expert_intermediate_size, 1, with_norm=False)
    else:
        mlp = mlp_params(m, m.ffn_hidden_size, 1, with_norm=False)
    return 2.0 * (attn + mlp), float(_attention_core_flops(m, seq))


def logits_forward_flops(cfg: RunConfig) -> float:
    """Output layer per token, forward: the padded vocabulary at the run's TP (what megatron-core builds)."""
    return 2.0 * cfg.model.hidden_size * derived.padded_vocab_size(cfg.model, cfg.parallel.tp)


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token (forward + backward, no recompute), the MFU numerator."""
    m, s = cfg.model, cfg.train.seq_length
    n_moe = sum(derived.is_moe_layer(m, i) for i in range(m.num_layers))
    fwd = sum(kind_forward_flops(m, False, s)) * (m.num_layers - n_moe)
    if n_moe:
        fwd += sum(kind_forward_flops(m, True, s)) * n_moe
    return 3.0 * (fwd + logits_forward_flops(cfg))


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
