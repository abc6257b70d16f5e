"""Two swaps in megatron-core's local (non-Transformer-Engine) layer spec, for machines without TE/Apex.

1. ``SDPAttention``: the local spec's ``DotProductAttention`` materialises the full ``[b*h, s, s]`` score
   matrix (baddbmm, masked softmax, bmm). This subclass computes the same attention with
   ``torch.nn.functional.scaled_dot_product_attention`` (flash/memory-efficient kernels on GPU, a fused
   kernel on CPU) and falls back to the parent for what SDPA does not express (sliding windows,
   learnable/off-by-one softmax, query-key layer scaling, attention dropout while training). Heads are
   independent, so the result does not depend on how TP splits them. The spec gets its CP-capable
   subclass (``context_parallel.ContextParallelSDPAttention``), which is this class at CP=1.
2. ``SequenceParallelTorchNorm``: without Apex the local spec builds norms with ``WrappedTorchNorm``,
   which refuses sequence parallelism because torch's norms do not mark their weights. Under SP each TP
   rank normalises only its slice of the sequence, so the weight gradients are partial sums that
   megatron-core's ``finalize_model_grads`` all-reduces over TP for parameters flagged
   ``sequence_parallel=True`` (as Apex's ``FusedLayerNorm`` flags them). This is the torch norm, flagged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

_CAUSAL = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)


class SDPAttention(DotProductAttention):
    """megatron-core's local core attention computed by ``scaled_dot_product_attention``."""

    def _sdpa_applies(self, query, value, attention_bias) -> bool:
        c = self.config
        head = self.hidden_size_per_attention_head
        return (
            attention_bias is None
            and query.size(-1) == value.size(-1) == head  # MLA-style unequal head dims: the parent's path
            and c.softmax_type == "vanilla"
            and not c.apply_query_key_layer_scaling
            and self.scale_mask_softmax.window_size is None
            and (self.attention_dropout.p == 0.0 or not self.training)
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or not self._sdpa_applies(query, value, attention_bias):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        # [s, b, heads, dim] -> [b, heads, s, dim]; query groups repeated as the parent does (GQA)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        mask_type = attn_mask_type or self.attn_mask_type
        mask: Optional[torch.Tensor] = None
        causal = False
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # megatron: True = masked out; SDPA: True = attend
        elif mask_type in _CAUSAL and q.size(2) > 1:
            causal = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
        sq, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


class SequenceParallelTorchNorm:
    """``torch.nn.RMSNorm``/``LayerNorm`` whose weights are flagged for megatron-core's SP grad all-reduce."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused: Any):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} has no sequence-parallel torch norm")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def _replace_modules(spec: Any, replacements: Dict[type, type]) -> Any:
    """A copy of a spec tree with the given module classes replaced (ModuleSpecs, partials, submodule dataclasses, lists)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def swap(node: Any) -> Any:
        if isinstance(node, type):
            return replacements.get(node, node)
        if isinstance(node, functools.partial):  # megatron-core 0.18 on: partial(MoELayer, submodules=...)
            return functools.partial(swap(node.func), *swap(list(node.args)), **{k: swap(v) for k, v in node.keywords.items()})
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(node, module=swap(node.module), submodules=swap(node.submodules))
        if isinstance(node, list):
            return [swap(item) for item in node]
        if dataclasses.is_dataclass(node):
            return dataclasses.replace(node, **{f.name: swap(getattr(node, f.name)) for f in dataclasses.fields(node) if f.init})
        return node

    return swap(spec)


def adapt_local_spec(spec: Any, config) -> Any:
    """The local spec with SDPA core attention (CP-capable), and SP-capable torch norms when SP is on."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_recipes.models.context_parallel import ContextParallelSDPAttention

    replacements: Dict[type, type] = {DotProductAttention: ContextParallelSDPAttention}
    if config.sequence_parallel:
        replacements[WrappedTorchNorm] = SequenceParallelTorchNorm
    return _replace_modules(spec, replacements)
