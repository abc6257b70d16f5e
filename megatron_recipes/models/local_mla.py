"""Multi-latent attention on megatron-core's local (non-TE) spec.

megatron-core 0.16's ``MLASelfAttention`` builds its core attention with ``k_channels``/``v_channels``
(query/key and value head sizes differ under MLA), which only Transformer Engine's attention accepts: the
local spec fails with ``unexpected keyword argument 'k_channels'``. The local ``DotProductAttention``
computes MLA correctly once its per-head output size is the value head size (scores use the tensors'
own head size and MLA passes its softmax scale), so this subclass takes the two arguments and sizes the
output from ``v_channels``. Used only where the TE spec is not (the CPU lane, conversion).

Two more defects of megatron-core's MLA module on this path (``HAVE_TE`` set with placeholder classes, the
YaRN embedding built for CUDA) are the ``local_mla`` rows of ``runtime/patches/``, applied here.
"""

from __future__ import annotations

import copy
from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_recipes.runtime import patches


class LocalMLACoreAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, *args, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, **kwargs):
        if v_channels is not None:
            config = copy.copy(config)
            config.kv_channels = v_channels
        super().__init__(config, layer_number, attn_mask_type, attention_type, *args, **kwargs)


def use_local_mla_attention(spec) -> None:
    """Swap the core attention of an MLA layer spec (in place) for ``LocalMLACoreAttention``."""
    patches.apply("local_mla")
    attention = getattr(spec.submodules, "self_attention", None)
    sub = getattr(attention, "submodules", None)
    if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention and hasattr(sub, "linear_kv_up_proj"):
        sub.core_attention = LocalMLACoreAttention
