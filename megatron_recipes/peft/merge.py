"""Fold adapters into the base weights and put the plain modules back (for export, or serving as is).

``W' = W + s B A`` (LoRA) or ``W' = m / ||W + s B A|| * (W + s B A)`` (DoRA), per rank on its own shard:
both factors are split like the base, so no communication is needed beyond DoRA's row norm. An NF4 base
is dequantised first (the merged model is what QLoRA trained: the quantised base plus the update).
"""

from __future__ import annotations

from typing import List

import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.peft.lora import LoRALinear
from megatron_recipes.peft.nf4_linear import NF4ParallelLinear
from megatron_recipes.peft.prefix import PrefixCoreAttention


def _replace(chunk: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(chunk.get_submodule(parent_path) if parent_path else chunk, attr, module)


@torch.no_grad()
def merge_and_unload(chunks: List[torch.nn.Module]) -> int:
    """Merge every LoRA/DoRA adapter into its base; returns how many modules were merged."""
    merged = 0
    for chunk in chunks:
        wrapped = [(p, m) for p, m in chunk.named_modules() if isinstance(m, (LoRALinear, PrefixCoreAttention))]
        for path, module in wrapped:
            if isinstance(module, PrefixCoreAttention):
                raise RecipeError(
                    "P-Tuning v2 prefixes are extra keys/values, not a weight update: they cannot be merged into the base",
                    fix="export LoRA-family runs only (peft.method lora, dora, qlora)",
                )
            weight = module.merged_weight()
            module.remove_hooks()
            base = module.base
            if isinstance(base, NF4ParallelLinear):
                base = base.to_dense(weight)
            else:
                base.weight.data.copy_(weight.to(base.weight.dtype))
            _replace(chunk, path, base)
            merged += 1
    return merged
