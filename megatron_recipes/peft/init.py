"""Adapter initialisation that does not depend on the parallel layout.

Each adapter tensor is drawn whole from a generator seeded by the run seed and the parameter's
layout-free name (global layer and expert indices), then each rank keeps its shard. TP=1 and TP=2 (or
PP=1 and PP=2) runs therefore start from identical adapters, which is what makes their losses comparable
step by step.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional, Sequence

import torch

Fill = Callable[[Sequence[int], torch.Generator], torch.Tensor]


def param_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2**63 - 1)


def uniform(bound: float) -> Fill:
    return lambda shape, g: (torch.rand(*shape, generator=g, dtype=torch.float32) * 2.0 - 1.0) * bound


def normal(std: float) -> Fill:
    return lambda shape, g: torch.randn(*shape, generator=g, dtype=torch.float32) * std


def zeros() -> Fill:
    return lambda shape, g: torch.zeros(*shape, dtype=torch.float32)


def sharded(
    fill: Fill,
    full_shape: Sequence[int],
    seed: int,
    name: str,
    shard_dim: Optional[int] = None,
    rank: int = 0,
    size: int = 1,
) -> torch.Tensor:
    """The whole tensor from ``fill``, then this rank's contiguous slice along ``shard_dim``."""
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    full = fill(full_shape, generator)
    if shard_dim is None or size == 1:
        return full
    return full.chunk(size, dim=shard_dim)[rank].contiguous()


def make_param(data: torch.Tensor, dtype: torch.dtype, device: torch.device, tp_dim: Optional[int], allreduce: bool = True):
    """A trainable parameter with megatron-core's tensor-parallel attributes (for grad-norm and checkpoints)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    param = torch.nn.Parameter(data.to(device=device, dtype=dtype))
    set_tensor_model_parallel_attributes(param, tp_dim is not None, tp_dim if tp_dim is not None else -1, 1)
    param.allreduce = allreduce
    return param
