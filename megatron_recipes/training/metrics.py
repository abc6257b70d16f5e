"""What a step costs: model FLOPs, MFU, tokens/s and peak memory.

FLOPs count the model's matrix multiplies (forward x3 for forward + backward), causal attention at
half the score/value products, the logits over the padded vocabulary, and for MoE only the routed
top-k experts. Recomputation is not counted: MFU measures useful work, not hardware work.
"""

from __future__ import annotations

import resource
import sys
from typing import Optional

import torch

from megatron_recipes.config import derived
from megatron_recipes.config.schema import ModelConfig, RunConfig


def _mlp_flops(m: ModelConfig, ffn: int) -> float:
    """Forward FLOPs per token of one (gated) MLP: two or three ``hidden x ffn`` matmuls."""
    matmuls = 3 if m.activation == "swiglu" else 2
    return 2.0 * matmuls * m.hidden_size * ffn


def _attention_flops(m: ModelConfig, seq: int) -> float:
    """Forward FLOPs per token of self-attention: projections plus causal scores and values."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk = (m.qk_head_dim or 0) + (m.qk_pos_emb_head_dim or 0)
        v = m.v_head_dim or 0
        q = h * m.q_lora_rank + m.q_lora_rank * heads * qk if m.q_lora_rank else h * heads * qk
        kv = h * (m.kv_lora_rank + (m.qk_pos_emb_head_dim or 0)) + m.kv_lora_rank * heads * ((m.qk_head_dim or 0) + v)
        proj = 2.0 * (q + kv + heads * v * h)
        return proj + 2.0 * seq / 2 * heads * (qk + v)
    d = derived.head_dim(m)
    proj = 2.0 * h * (heads + 2 * m.num_query_groups) * d + 2.0 * heads * d * h
    return proj + 2.0 * 2 * seq / 2 * heads * d


def _layer_mlp_flops(m: ModelConfig, is_moe_layer: bool) -> float:
    if not is_moe_layer:
        return _mlp_flops(m, m.ffn_hidden_size)
    expert = _mlp_flops(m, m.moe_ffn_hidden_size or m.ffn_hidden_size) * m.moe_router_topk
    shared = _mlp_flops(m, m.moe_shared_expert_intermediate_size) if m.moe_shared_expert_intermediate_size else 0.0
    return expert + shared + 2.0 * m.hidden_size * m.num_moe_experts


def flops_per_token(cfg: RunConfig) -> float:
    """Training (forward + backward) model FLOPs per token."""
    m, seq = cfg.model, cfg.train.seq_length
    layers = sum(_attention_flops(m, seq) + _layer_mlp_flops(m, bool(moe)) for moe in derived.moe_layer_pattern(m))
    logits = 2.0 * m.hidden_size * derived.padded_vocab_size(m, cfg.parallel.tp)
    return 3.0 * (layers + logits)


def tokens_per_step(cfg: RunConfig) -> int:
    return cfg.train.global_batch_size * cfg.train.seq_length


def flops_per_step(cfg: RunConfig) -> float:
    return flops_per_token(cfg) * tokens_per_step(cfg)


def mfu(cfg: RunConfig, step_time_s: float) -> Optional[float]:
    """Model FLOPs utilisation over all ranks; None when the cluster has no peak rate (CPU)."""
    peak = cfg.cluster.peak_bf16_tflops * 1e12 * derived.world_size(cfg)
    if peak <= 0 or step_time_s <= 0:
        return None
    return flops_per_step(cfg) / step_time_s / peak


def peak_memory_gib() -> float:
    """Peak allocated device memory on GPU; peak resident set size of this process on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def max_over_ranks(value: float) -> float:
    """The largest value across all ranks (the one that limits a job), as a float on every rank."""
    if not torch.distributed.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())
