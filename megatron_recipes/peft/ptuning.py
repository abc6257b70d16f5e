"""P-Tuning v2 (deep prompt tuning): trainable key/value prefixes in every attention layer.

megatron-core's attention has no input for extra keys/values, but it calls its ``core_attention``
submodule with the rotated query/key/value right before the softmax. ``PrefixCoreAttention`` replaces that
submodule (a public attribute built from the layer spec): it puts the layer's prefix keys/values in
front of the sequence's and widens the attention mask so every query sees every prefix slot, then calls
the original core attention unchanged. Prefixes carry no rotary position (they are learned in the
rotated space), and real tokens keep positions ``0..s-1``.

Split: prefixes live per query group, so under TP each rank holds the groups of its heads (the same
split as ``linear_qkv``'s K/V); under PP each stage holds its own layers' prefixes. With
``prefix_projection`` each layer's prefixes come from ``tanh(E W1^T + b1) W2^T + b2`` (as in P-Tuning v2,
one MLP per layer so pipeline stages stay independent); ``W2``/``b2`` are split by query group like the
prefixes, ``E``/``W1``/``b1`` are replicated and their gradients summed over TP inside autograd.

Local spec: the mask is built explicitly (``[1|b, 1, s, p + s]``). TE spec: causal attention becomes
``causal_bottom_right`` (the same mask for ``p + s`` keys), an explicit mask becomes ``arbitrary``.
Packed THD sequences (TE) would need per-sequence prefixes and are refused.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from megatron_recipes.checkpoint import AdapterModule
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.peft.linears import keep_child_keys, make_param, normal, sharded, uniform


class PrefixKV(torch.nn.Module):
    """One layer's prefix keys and values for this rank's query groups."""

    def __init__(self, config, name: str, length: int, projection: bool, hidden: int, seed: int, tp_group, device):
        super().__init__()
        groups, head_dim = config.num_query_groups, config.kv_channels
        tp = tp_group.size() if tp_group is not None else 1
        rank = tp_group.rank() if tp_group is not None else 0
        self.length, self.projection, self.tp_group, self.tp = length, projection, tp_group, tp
        self.local_groups, self.head_dim = groups // tp, head_dim
        dtype = config.params_dtype
        dev = device
        std = config.init_method_std
        if not projection:
            for part in ("key", "value"):
                full = sharded(normal(std), (length, groups, head_dim), seed, f"{name}.prefix.{part}", 1, rank, tp)
                setattr(self, part, make_param(full, dtype, dev, 1))
            return
        h = config.hidden_size
        self.embedding = make_param(sharded(normal(1.0), (length, h), seed, f"{name}.prefix.embedding"), dtype, dev, None)
        w1 = sharded(uniform(1 / math.sqrt(h)), (hidden, h), seed, f"{name}.prefix.w1")
        self.w1 = make_param(w1, dtype, dev, None)
        self.b1 = make_param(torch.zeros(hidden), dtype, dev, None)
        # rows ordered [group, key|value, head_dim] so a contiguous split by group is the TP split
        w2 = sharded(uniform(1 / math.sqrt(hidden)), (groups, 2, head_dim, hidden), seed, f"{name}.prefix.w2", 0, rank, tp)
        self.w2 = make_param(w2.reshape(-1, hidden), dtype, dev, 0)
        self.b2 = make_param(torch.zeros(self.local_groups * 2 * head_dim), dtype, dev, 0)

    def tp_axes(self) -> dict:
        return {"key": 1, "value": 1} if not self.projection else {"w2": 0, "b2": 0}

    def forward(self, batch: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[p, batch, groups_local, head_dim]``."""
        if self.projection:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            hidden = torch.tanh(torch.nn.functional.linear(self.embedding, self.w1, self.b1))
            if self.tp > 1:
                hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
            out = torch.nn.functional.linear(hidden, self.w2, self.b2)
            out = out.view(self.length, self.local_groups, 2, self.head_dim)
            key, value = out[:, :, 0], out[:, :, 1]
        else:
            key, value = self.key, self.value
        expand = (self.length, batch, self.local_groups, self.head_dim)
        return key.unsqueeze(1).expand(expand).to(dtype), value.unsqueeze(1).expand(expand).to(dtype)


def _is_te_attention(module: torch.nn.Module) -> bool:
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except Exception:
        return False
    return isinstance(TEDotProductAttention, type) and isinstance(module, TEDotProductAttention)


class PrefixCoreAttention(torch.nn.Module, AdapterModule):
    """The original core attention, called with prefix keys/values in front and the mask widened."""

    def __init__(self, inner: torch.nn.Module, prefix: PrefixKV):
        super().__init__()
        self.inner = inner
        self.prefix = prefix
        self.te = _is_te_attention(inner)
        keep_child_keys(self, "inner", own=("prefix.",))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None, **kwargs):
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params is not None:
            raise RecipeError(
                "P-Tuning v2 cannot run on packed (THD) sequences: each packed sequence would need its own prefix",
                fix="set data.packing=false for P-Tuning runs",
            )
        p = self.prefix.length
        pk, pv = self.prefix(query.size(1), key.dtype)
        key = torch.cat([pk, key], dim=0)
        value = torch.cat([pv, value], dim=0)
        if self.te and attention_mask is None:
            mask, mask_type = None, AttnMaskType.causal_bottom_right
        else:
            mask, mask_type = _widen_mask(attention_mask, query.size(0), key.size(0) - p, p, query.device), AttnMaskType.arbitrary
        return self.inner(
            query, key, value, mask, attn_mask_type=mask_type, attention_bias=attention_bias, packed_seq_params=None, **kwargs
        )

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        destination = self.inner.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return self.prefix.state_dict(destination=destination, prefix=f"{prefix}prefix.", keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = self.inner.sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(self.adapter_sharded_state_dict(prefix, sharded_offsets, metadata))
        return out

    def adapter_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        metadata = metadata or {}
        dp_cp_group = metadata.get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.prefix.state_dict(keep_vars=True),
            f"{prefix}prefix.",
            self.prefix.tp_axes(),
            sharded_offsets,
            tp_group=self.prefix.tp_group or parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=dp_cp_group,
        )

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


def _widen_mask(mask: Optional[torch.Tensor], sq: int, sk: int, p: int, device) -> torch.Tensor:
    """Boolean mask (True = hidden) for ``p`` prefix slots + ``sk`` keys; causal when ``mask`` is None."""
    if mask is None:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1 + sk - sq).view(1, 1, sq, sk)
    mask = mask.to(torch.bool)
    visible = torch.zeros(*mask.shape[:-1], p, dtype=torch.bool, device=mask.device)
    return torch.cat([visible, mask], dim=-1)
