"""Quantities every tool derives from a recipe the same way (world size, DP, padded vocab, ...).

Pure functions of a ``RunConfig``: the planner, the trainer, conversion and launch all call these,
so a layout means the same thing everywhere.
"""

from __future__ import annotations

import math
from typing import Optional

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
    return padded_rows(model.vocab_size, model.make_vocab_size_divisible_by, tp)


def padded_rows(vocab_size: int, divisible_by: int, tp: int) -> int:
    """``padded_vocab_size`` from the three numbers (a checkpoint described by another tool's config)."""
    multiple = max(1, divisible_by) * max(1, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def head_dim(model: ModelConfig) -> int:
    return model.kv_channels if model.kv_channels else model.hidden_size // model.num_attention_heads


def is_moe(model: ModelConfig) -> bool:
    return bool(model.num_moe_experts)


def is_moe_layer(model: ModelConfig, layer: int) -> bool:
    """Whether global layer ``layer`` is an MoE layer (the leading moe_first_dense_layers stay dense)."""
    return is_moe(model) and layer >= model.moe_first_dense_layers


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """Per-layer 1 (MoE) / 0 (dense), as megatron-core's ``moe_layer_freq`` list accepts."""
    return [int(is_moe_layer(model, i)) for i in range(model.num_layers)]


def lr_decay_iters(cfg: RunConfig) -> int:
    return cfg.optimizer.lr_decay_iters or cfg.train.train_iters


def lr_warmup_iters(cfg: RunConfig) -> int:
    """Warm-up steps: ``lr_warmup_iters`` when set, else ``floor(lr_warmup_fraction * decay horizon)``, else 0."""
    o = cfg.optimizer
    if o.lr_warmup_iters is not None:
        return o.lr_warmup_iters
    if o.lr_warmup_fraction is not None:
        return int(math.floor(o.lr_warmup_fraction * lr_decay_iters(cfg)))
    return 0


def virtual_pipeline_size(cfg: RunConfig) -> int:
    return cfg.parallel.vpp or 1


def pipeline_stage_layers(cfg: RunConfig) -> list[list[range]]:
    """Global layer indices held by each (pp_rank, vp_stage), in megatron-core's placement.

    Virtual stages are filled in schedule order (chunk-major, then pipeline rank), each chunk taking
    its share: ``num_layers_in_first/last_pipeline_stage / vpp`` on the first/last rank when set, the
    remaining layers split evenly over the other ranks. With ``account_for_embedding/loss_in_pipeline_split``
    the embedding and the loss each take one layer's slot: the first chunk of rank 0 and the last chunk
    of the last rank build one layer fewer (megatron-core's ``get_num_layers_to_build``). Counts that
    do not divide are floored; the validation rules report such layouts. ``parallel.pipeline_layout``, when
    set, says it stage by stage.
    """
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, vpp = max(1, p.pp), virtual_pipeline_size(cfg)
    if p.pipeline_layout:  # the layout names every stage's layers (validated by rule pp.pipeline_layout)
        from megatron_recipes.config import pipeline_layout

        return pipeline_layout.decoder_ranges(p.pipeline_layout, pp)
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if pp == 1:
        first = last = None
    emb = int(p.account_for_embedding_in_pipeline_split and first is None and last is None)
    loss = int(p.account_for_loss_in_pipeline_split and first is None and last is None)
    slots = layers + emb + loss
    middle_ranks = pp - (first is not None) - (last is not None)
    middle_layers = slots - (first or 0) - (last or 0)
    per_middle_rank = middle_layers // middle_ranks if middle_ranks > 0 else 0

    def chunk_size(rank: int, v: int) -> int:
        if rank == 0 and first is not None:
            return first // vpp
        if rank == pp - 1 and last is not None:
            return last // vpp
        n = per_middle_rank // vpp
        n -= emb if (rank == 0 and v == 0) else 0
        n -= loss if (rank == pp - 1 and v == vpp - 1) else 0
        return max(0, n)

    stages: list[list[range]] = [[range(0)] * vpp for _ in range(pp)]
    offset = 0
    for v in range(vpp):
        for rank in range(pp):
            n = chunk_size(rank, v)
            stages[rank][v] = range(offset, offset + n)
            offset += n
    return stages


def mtp_stage(cfg: RunConfig) -> Optional[tuple]:
    """(pipeline rank, virtual stage) of the chunk holding the MTP layers: the last chunk of the last rank,
    unless ``parallel.pipeline_layout`` puts them elsewhere (None without MTP). That chunk needs the input ids
    and the labels: the MTP block embeds the shifted tokens and computes its own loss."""
    if not cfg.model.mtp_num_layers:
        return None
    pp, vpp = max(1, cfg.parallel.pp), virtual_pipeline_size(cfg)
    if cfg.parallel.pipeline_layout:
        from megatron_recipes.config import pipeline_layout

        return pipeline_layout.mtp_stage(cfg.parallel.pipeline_layout, pp)
    return pp - 1, vpp - 1


def mtp_pipeline_rank(cfg: RunConfig) -> Optional[int]:
    """The pipeline rank holding the MTP layers (None without MTP)."""
    where = mtp_stage(cfg)
    return None if where is None else where[0]


def layers_on_pipeline_rank(cfg: RunConfig, pp_rank: int) -> list[int]:
    """Global indices of every transformer layer on one pipeline rank (all its virtual chunks)."""
    return [i for chunk in pipeline_stage_layers(cfg)[pp_rank] for i in chunk]
