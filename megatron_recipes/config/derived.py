"""Quantities every tool derives from a recipe the same way (world size, DP, padded vocab, ...).

Pure functions of a ``RunConfig``: the planner, the trainer, conversion and launch all call these,
so a layout means the same thing everywhere.
"""

from __future__ import annotations

import math

from megatron_recipes.config.schema import ModelConfig, RunConfig


def world_size(cfg: RunConfig) -> int:
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node


def model_parallel_size(cfg: RunConfig) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp


def data_parallel_size(cfg: RunConfig) -> int:
    """DP = world / (tp * pp * cp); 0 when the world does not factorise (a validation rule reports it)."""
    mp = model_parallel_size(cfg)
    world = world_size(cfg)
    return world // mp if mp and world % mp == 0 else 0


def expert_tensor_parallel_size(cfg: RunConfig) -> int:
    return cfg.parallel.etp if cfg.parallel.etp is not None else cfg.parallel.tp


def expert_data_parallel_size(cfg: RunConfig) -> int:
    """Experts are replicated over world / (etp * ep * pp), megatron-core's expert-DP group."""
    p = cfg.parallel
    denom = expert_tensor_parallel_size(cfg) * p.ep * p.pp
    world = world_size(cfg)
    return world // denom if denom and world % denom == 0 else 0


def num_microbatches(cfg: RunConfig) -> int:
    """Microbatches per step per DP rank (gradient accumulation); 0 if the batch does not divide."""
    dp = data_parallel_size(cfg)
    per_step = cfg.train.micro_batch_size * dp
    t = cfg.train
    return t.global_batch_size // per_step if per_step and t.global_batch_size % per_step == 0 else 0


def padded_vocab_size(model: ModelConfig, tp: int) -> int:
    """Megatron pads the embedding rows to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = max(1, model.make_vocab_size_divisible_by) * max(1, tp)
    return int(math.ceil(model.vocab_size / multiple) * multiple)


def head_dim(model: ModelConfig) -> int:
    return model.kv_channels if model.kv_channels else model.hidden_size // model.num_attention_heads


def is_moe(model: ModelConfig) -> bool:
    return bool(model.num_moe_experts)


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """Per-layer 1 (MoE) / 0 (dense), as megatron-core's ``moe_layer_freq`` list accepts."""
    if not is_moe(model):
        return [0] * model.num_layers
    return [0 if i < model.moe_first_dense_layers else 1 for i in range(model.num_layers)]


def lr_decay_iters(cfg: RunConfig) -> int:
    return cfg.optimizer.lr_decay_iters or cfg.train.train_iters
