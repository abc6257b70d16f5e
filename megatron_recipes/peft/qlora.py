"""QLoRA's base: a frozen tensor-parallel linear whose weight is stored as NF4 and dequantised on the fly.

It replaces a base ``ColumnParallelLinear``/``RowParallelLinear`` (or a TE spec linear) and keeps its
contract: same input/output layout, same communication through megatron-core's public mapping functions
(sequence-parallel all-gather or gradient all-reduce on the input of a column layer; all-reduce or
reduce-scatter on the output of a row layer; none for expert layers, where the dispatcher communicates),
same ``(output, bias)`` return. The dense weight never stays in memory: the matmul dequantises it in the
forward and again in the backward, saving nothing weight-sized for backward.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.peft import nf4
from megatron_recipes.config.schema import PeftConfig
from megatron_recipes.peft.linears import LinearLayout, keep_child_keys, layout_of

PartialFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _NF4MatMul(torch.autograd.Function):
    """``x @ W^T`` with W dequantised in forward and backward; W takes no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, owner: "NF4ParallelLinear") -> torch.Tensor:
        ctx.owner = owner
        return torch.matmul(x, owner.dequantized(x.dtype).t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return torch.matmul(grad, ctx.owner.dequantized(grad.dtype)), None


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto`` picks bitsandbytes on a GPU when it imports, torch otherwise; ``bnb`` must be honoured."""
    if requested not in ("auto", "torch", "bnb"):
        raise RecipeError(f"peft.nf4_backend={requested!r} is not known", fix="use auto, torch or bnb")
    if requested == "torch":
        return "torch"
    usable = device.type == "cuda" and nf4.bnb_available()
    if requested == "bnb" and not usable:
        raise RecipeError(
            "peft.nf4_backend=bnb needs bitsandbytes on a CUDA device, which is not available here",
            fix="install bitsandbytes on the GPU nodes, or set peft.nf4_backend=torch (same numerics, slower)",
        )
    return "bnb" if usable else "torch"


class NF4ParallelLinear(torch.nn.Module):
    """The base layer with its weight replaced by NF4 buffers (bias and fused norm weights kept, frozen)."""

    def __init__(self, base: torch.nn.Module, layout: LinearLayout, block_size: int, double_quant_block_size: Optional[int], backend: str):
        super().__init__()
        if layout.gather_output:
            raise RecipeError("QLoRA does not support column layers with gather_output=True", fix="target another module")
        weight = base.weight.detach()
        self.dense_dtype = weight.dtype
        self.weight_allreduce = bool(getattr(base.weight, "allreduce", True))  # False: expert-parallel weight
        q = nf4.quantize_nf4(weight, block_size, double_quant_block_size)
        self.block_size, self.double_quant_block_size, self.shape = block_size, double_quant_block_size, q.shape
        # Non-persistent: QLoRA checkpoints hold adapters only; the base is re-quantised from the pretrained weights.
        self.register_buffer("qweight", q.packed, persistent=False)
        self.register_buffer("qabsmax", q.absmax, persistent=False)
        self.register_buffer("qabsmax2", q.absmax2, persistent=False)
        self.register_buffer("qoffset", q.offset, persistent=False)
        base.register_parameter("weight", None)  # drop the dense copy; bias/norm params stay on ``base``
        for param in base.parameters():
            param.requires_grad_(False)
        self.base = base
        self.layout = dataclasses.replace(layout, engine="nf4")
        self.backend = backend
        keep_child_keys(self, "base")

    # -- storage -------------------------------------------------------------------------------------
    def qtensor(self) -> nf4.NF4Tensor:
        return nf4.NF4Tensor(
            self.qweight, self.qabsmax, self.qabsmax2, self.qoffset, self.shape, self.block_size, self.double_quant_block_size
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.backend == "bnb":
            return nf4.bnb_dequantize(self.qtensor(), dtype)
        return nf4.dequantize_nf4(self.qtensor(), dtype)

    def quantized_nbytes(self) -> int:
        return self.qtensor().nbytes()

    @property
    def weight_numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def to_dense(self, weight: Optional[torch.Tensor] = None) -> torch.nn.Module:
        """The original module again, holding ``weight`` (default: the dequantised base) as its frozen weight."""
        dense = self.dequantized(self.dense_dtype) if weight is None else weight.to(self.dense_dtype)
        self.base.weight = torch.nn.Parameter(dense.contiguous(), requires_grad=False)
        return self.base

    # -- forward ---------------------------------------------------------------------------------------
    def _bias(self):
        bias = getattr(self.base, "bias", None)
        return bias if bias is not None and bias.numel() > 0 else None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """TE's fused input norm (RMSNorm or LayerNorm), computed in fp32 like TE does."""
        b = self.base
        weight = b.layer_norm_weight.float()
        if getattr(b, "zero_centered_gamma", False):
            weight = weight + 1.0
        xf = x.float()
        if getattr(b, "normalization", "RMSNorm") == "RMSNorm":
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + b.eps) * weight
        else:
            bias = b.layer_norm_bias.float() if getattr(b, "layer_norm_bias", None) is not None else None
            out = F.layer_norm(xf, (xf.shape[-1],), weight, bias, b.eps)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, partial_fn: Optional[PartialFn] = None, return_input: bool = False):
        """``(output, bias)`` like the base; ``partial_fn(x_local, partial_out)`` is added before a row
        layer's reduction; ``return_input`` also returns what the matmul saw (after a fused norm)."""
        from megatron.core import tensor_parallel as tpl

        lay, group = self.layout, self.layout.tp_group
        bias = self._bias()
        if lay.kind == "column":
            x = self._norm(x) if lay.fused_norm else x
            seen = x
            if lay.communicates and lay.sequence_parallel:
                x = tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
            elif lay.communicates:
                x = tpl.copy_to_tensor_model_parallel_region(x, group=group)
            out = _NF4MatMul.apply(x, self)
        else:
            if not lay.input_is_parallel:
                x = tpl.scatter_to_tensor_model_parallel_region(x, group=group)
            seen = x
            out = _NF4MatMul.apply(x, self)
            if partial_fn is not None:
                out = out + partial_fn(x, out)
            if lay.communicates and lay.sequence_parallel:
                out = tpl.reduce_scatter_to_sequence_parallel_region(out, group=group)
            elif lay.communicates:
                out = tpl.reduce_from_tensor_model_parallel_region(out, group=group)
        out_bias = None
        if bias is not None:
            if lay.skip_bias_add:
                out_bias = bias
            else:
                out = out + bias
        return (out, out_bias, seen) if return_input else (out, out_bias)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The base's remaining entries (bias, norm) under the base's own keys."""
        return self.base.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.base.sharded_state_dict(prefix, sharded_offsets, metadata)

    def backward_dw(self) -> None:
        return None

    def __repr__(self) -> str:
        return (
            f"NF4ParallelLinear({self.layout.kind}, in={self.layout.in_local}, out={self.layout.out_local}, "
            f"block={self.block_size}, double_quant={self.double_quant_block_size}, backend={self.backend})"
        )


# --- replacing the targeted linears by NF4 ones, after checking every one can be quantised -----------


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
