"""Pipeline-schedule arithmetic: microbatches in flight per stage and the bubble.

1F1B (megatron-core's ``forward_backward_pipelining_without_interleaving``): stage ``r`` of ``pp`` runs
``pp - r - 1`` warm-up forwards, so at most ``min(M, pp - r)`` microbatches' activations are alive.
Interleaved (``vpp`` chunks): warm-up is ``2 (pp - r - 1) + (vpp - 1) pp`` chunk-microbatches, plus
the one in steady state, each holding one chunk (1/vpp of the stage's layers).
With ``overlap_moe_expert_parallel_comm`` (the combined 1F1B schedule) one forward runs beside another
microbatch's backward: the interleaved warm-up takes one chunk-microbatch more, and without pipelining two
microbatches are alive at once (megatron-core's ``get_pp_rank_microbatches``, ``combined_1f1b.py``).
Bubble: ``(pp - 1) / vpp`` idle microbatch slots against ``M`` useful ones, i.e. a fraction
``b / (M + b)`` of the step with ``b = (pp - 1) / vpp``.
"""

from __future__ import annotations

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig


def chunk_microbatches_in_flight(cfg: RunConfig, pp_rank: int) -> int:
    """Chunk-microbatches whose activations stage ``pp_rank`` holds at its peak."""
    pp, vpp = max(1, cfg.parallel.pp), derived.virtual_pipeline_size(cfg)
    m = max(1, derived.num_microbatches(cfg))
    combined = cfg.parallel.overlap_moe_expert_parallel_comm
    if pp == 1:  # no pipelining: one microbatch through every chunk, then its backward
        return vpp * (2 if combined and m > 1 else 1)
    if vpp == 1:
        return min(m, pp - pp_rank)
    warmup = 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + (1 if combined else 0)
    return min(m * vpp, warmup + 1)


def bubble_slots(cfg: RunConfig) -> float:
    return (max(1, cfg.parallel.pp) - 1) / derived.virtual_pipeline_size(cfg)


def bubble_fraction(cfg: RunConfig) -> float:
    """Share of a step the average stage sits idle waiting for the pipeline to fill and drain."""
    b = bubble_slots(cfg)
    m = max(1, derived.num_microbatches(cfg))
    return b / (m + b)
