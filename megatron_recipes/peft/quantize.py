"""QLoRA's base: replace targeted linears by NF4 ones, after checking every one can be quantised."""

from __future__ import annotations

import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import PeftConfig
from megatron_recipes.peft.layout import layout_of
from megatron_recipes.peft.nf4_linear import NF4ParallelLinear, resolve_backend


def check_quantizable(target, p: PeftConfig) -> None:
    """Blocks must tile each rank's rows exactly, so TP=1 and TP=N hold the same first-level blocks."""
    lay = layout_of(target.module)
    if p.nf4_block_size < 2 or p.nf4_block_size % 2:
        raise RecipeError(f"peft.nf4_block_size={p.nf4_block_size} must be an even number >= 2", fix="use 64 (QLoRA's value)")
    if lay.in_local % p.nf4_block_size:
        raise RecipeError(
            f"peft.nf4_block_size={p.nf4_block_size} does not divide the {lay.in_local} input features per rank of "
            f"{target.canonical} ({lay.in_full} in total, split {lay.tp_size} ways)",
            fix="use a block size that divides it (64 is QLoRA's value) or a tensor-parallel size that keeps it whole",
        )
    if p.double_quant and p.double_quant_block_size < 1:
        raise RecipeError(f"peft.double_quant_block_size={p.double_quant_block_size} must be >= 1", fix="use 256")


def quantize_module(base: torch.nn.Module, p: PeftConfig) -> NF4ParallelLinear:
    backend = resolve_backend(p.nf4_backend, base.weight.device)
    return NF4ParallelLinear(
        base,
        layout_of(base),
        p.nf4_block_size,
        p.double_quant_block_size if p.double_quant else None,
        backend,
    )
