"""Rank functions for the sharding tests: train a few steps from one starting point, and count the bytes
megatron-core allocated for parameters, gradient buffers and optimizer state on this rank."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import peft_support as ps


def _nbytes(t) -> int:
    """Bytes this rank holds: a DTensor (Megatron-FSDP's optimizer state) counts its local shard only."""
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def allocated_state_bytes(model: List[torch.nn.Module], optimizer) -> Dict[str, int]:
    """What this rank holds, read from megatron-core's own buffers (not from our estimate).

    Megatron-FSDP: each parameter group's model-weight / main-grad DataParallelBuffer (``.data`` is this
    rank's shard when the buffer is distributed), and its main-weight buffer (the fp32 master, counted as
    optimizer state as the estimate does). Megatron DDP: each
    ``_ParamAndGradBuffer``'s ``param_data`` (only with the distributed optimizer) and ``grad_data``.
    Optimizer: every tensor in the inner torch optimizer's state except the scalar ``step``, plus the
    distributed optimizer's fp32 master shards of 16-bit params.
    """
    weights = grads = opt = 0
    for chunk in model:
        fsdp_buffer = getattr(chunk, "param_and_grad_buffer", None)
        if fsdp_buffer is not None and hasattr(fsdp_buffer, "parameter_groups"):
            for g in fsdp_buffer.parameter_groups:  # the main-weight buffer is the fp32 master: optimizer state
                weights += _nbytes(g.model_weight_buffer.data) if g.model_weight_buffer else 0
                opt += _nbytes(g.main_weight_buffer.data) if g.main_weight_buffer else 0
                grads += _nbytes(g.main_grad_buffer.data) if g.main_grad_buffer else 0
            continue
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            weights += _nbytes(buffer.param_data)
            grads += _nbytes(buffer.grad_data)
        if not chunk.buffers or chunk.buffers[0].param_data is None:  # params are not backed by a buffer
            weights += sum(_nbytes(p) for p in chunk.parameters())
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = part.optimizer
        for state in inner.state.values():
            opt += sum(_nbytes(v) for k, v in state.items() if torch.is_tensor(v) and k != "step")
        for group in getattr(part, "shard_fp32_from_float16_groups", []) or []:
            opt += sum(_nbytes(p) for p in group)
    return {"weights": weights, "grads": grads, "optimizer": opt}


def sharding_cfg(world: int, *overrides: str):
    """The PEFT tests' tiny setting with global batches of 8: two micro-batches per rank at DP=2, so the
    modes' gradient accumulation (no_sync between micro-batches) is exercised too."""
    from megatron_recipes.config.compose import compose_recipe

    base = [o for o in ps.TINY_BASE if not o.startswith("train.global_batch_size=")]
    return compose_recipe("tiny_llama_cpu", ["parallel=none", *base, f"cluster.gpus_per_node={world}", "train.global_batch_size=8", *overrides])


def train_and_measure(world: int, overrides: List[str], steps: int) -> Dict[str, Any]:
    """``steps`` steps from one fixed starting model (same on every layout); losses and allocated bytes."""
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime.distributed import init_model_parallel

    cfg = sharding_cfg(world, *overrides)
    init_model_parallel(cfg)
    chunks = build_model_chunks(cfg)
    ps.set_base_weights(chunks)
    model, optimizer, _, losses = ps._optimize(cfg, chunks, steps)
    return {"losses": losses, "allocated": allocated_state_bytes(model, optimizer)}
