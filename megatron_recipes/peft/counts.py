"""Whole-model parameter counts from the pieces each rank holds (what PEFT users see at start).

A parameter is counted on the ranks that own a unique piece of it: tensor-parallel shards everywhere,
replicated tensors on TP rank 0 only; then dense counts are summed over the TP x PP group and expert
counts over the expert TP x EP x PP group. NF4 base weights are not parameters; they count with their
logical size (as HF PEFT counts 4-bit weights) and their stored bytes are reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Tuple

import torch


@dataclass
class ParamTotals:
    trainable: int
    total: int
    quantized_bytes: int  # NF4 storage of quantised base weights (whole model)
    quantized_numel: int

    @staticmethod
    def targeted_bf16_bytes(chunks: List[torch.nn.Module], cfg) -> int:
        """Bytes the base weights that QLoRA will quantise take as bf16 (whole model)."""
        from megatron_recipes.peft.targets import find_targets

        local_dense = local_expert = 0
        for name, targets in find_targets(chunks, list(cfg.peft.target_modules)).items():
            for t in targets:
                n = t.module.weight.numel() * 2
                if name.startswith("expert_"):
                    local_expert += n
                else:
                    local_dense += n
        dense, expert = _reduce([local_dense, 0, 0, 0], [local_expert, 0, 0, 0])
        return dense[0] + expert[0]


def _is_expert(name: str) -> bool:
    """Routed-expert tensors (split over expert TP x EP) live under ``mlp.experts.``."""
    return ".experts." in f".{name}"


def _unique_here(param: torch.nn.Parameter, expert: bool, tp_rank: int, etp_rank: int) -> bool:
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (etp_rank if expert else tp_rank) == 0


def _reduce(dense: List[int], expert: List[int]) -> Tuple[List[int], List[int]]:
    from megatron.core import parallel_state

    d = torch.tensor(dense, dtype=torch.int64)
    e = torch.tensor(expert, dtype=torch.int64)
    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
        torch.distributed.all_reduce(d, group=parallel_state.get_model_parallel_group())
        torch.distributed.all_reduce(e, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return d.tolist(), e.tolist()


def _ranks() -> Tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()


def _local_counts(chunks: Iterable[torch.nn.Module]) -> Tuple[List[int], List[int]]:
    from megatron_recipes.peft.nf4_linear import NF4ParallelLinear

    tp_rank, etp_rank = _ranks()
    dense = [0, 0, 0, 0]  # trainable, total, quantized bytes, quantized numel
    expert = [0, 0, 0, 0]
    for chunk in chunks:
        first_stage = getattr(chunk, "pre_process", True)
        for name, param in chunk.named_parameters():
            if getattr(param, "shared", False) and not first_stage:
                continue  # tied output weight on the last stage: the embedding already counted it
            is_expert = _is_expert(name)
            if not _unique_here(param, is_expert, tp_rank, etp_rank):
                continue
            bucket = expert if is_expert else dense
            bucket[1] += param.numel()
            if param.requires_grad:
                bucket[0] += param.numel()
        for module in chunk.modules():
            if isinstance(module, NF4ParallelLinear):
                bucket = expert if module.layout.is_expert else dense
                bucket[1] += module.weight_numel
                bucket[2] += module.quantized_nbytes()
                bucket[3] += module.weight_numel
    return dense, expert


def count_parameters(chunks: List[torch.nn.Module]) -> ParamTotals:
    dense, expert = _reduce(*_local_counts(chunks))
    both = [a + b for a, b in zip(dense, expert)]
    return ParamTotals(trainable=both[0], total=both[1], quantized_bytes=both[2], quantized_numel=both[3])
