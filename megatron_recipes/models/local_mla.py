"""Multi-latent attention on megatron-core's local (non-TE) spec.

megatron-core 0.16's ``MLASelfAttention`` builds its core attention with ``k_channels``/``v_channels``
(query/key and value head sizes differ under MLA), which only Transformer Engine's attention accepts: the
local spec fails with ``unexpected keyword argument 'k_channels'``. The local ``DotProductAttention``
computes MLA correctly once its per-head output size is the value head size (scores use the tensors'
own head size and MLA passes its softmax scale), so this subclass takes the two arguments and sizes the
output from ``v_channels``. Used only where the TE spec is not (the CPU lane, conversion).

The same module also reports ``HAVE_TE`` when Transformer Engine is absent (megatron-core's TE wrapper
module imports fine, with ``MagicMock`` placeholders) and then calls ``isinstance(x, <MagicMock>)``; the
flag is corrected when the wrapper is not a real class. And MLA builds its YaRN rotary embedding without
``use_cpu_initialization``, so on a machine without CUDA it asks for ``torch.device(0)``; there the
embedding is made on the CPU (which that flag exists for).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class LocalMLACoreAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, **kwargs):
        if v_channels is not None:
            config = copy.copy(config)
            config.kv_channels = v_channels
        super().__init__(config, layer_number, attn_mask_type, attention_type, *args, **kwargs)


def _fix_have_te() -> None:
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(getattr(multi_latent_attention, "TELinear", None), type):
        multi_latent_attention.HAVE_TE = False


def _yarn_on_cpu() -> None:
    from megatron.core.transformer import multi_latent_attention

    original = multi_latent_attention.YarnRotaryEmbedding
    if torch.cuda.is_available() or getattr(original, "on_cpu", False):
        return

    class CpuYarnRotaryEmbedding(original):
        on_cpu = True

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("use_cpu_initialization", True)
            super().__init__(*args, **kwargs)

    multi_latent_attention.YarnRotaryEmbedding = CpuYarnRotaryEmbedding


def use_local_mla_attention(spec) -> None:
    """Swap the core attention of an MLA layer spec (in place) for ``LocalMLACoreAttention``."""
    _fix_have_te()
    _yarn_on_cpu()
    attention = getattr(spec.submodules, "self_attention", None)
    sub = getattr(attention, "submodules", None)
    if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention and hasattr(sub, "linear_kv_up_proj"):
        sub.core_attention = LocalMLACoreAttention
