"""The checkpoint's shape: every tensor megatron-core's dist-checkpointing would store for a model.

Rather than restating megatron-core's naming rules (TE key names, layers stacked on a leading axis or
keyed per layer, experts on their own axis, the swiglu split), the engine asks megatron-core: it builds
the model on the ``meta`` device (no memory) at TP=PP=EP=1 in a one-rank group and reads
``sharded_state_dict()``. Global shapes do not depend on the layout, except the padded vocabulary, which
is set to the target layout's. Each resulting ``Item`` is one (key, layer, expert) tensor: the unit the
import writes and the export reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_recipes import checkpoint
from megatron_recipes.config.schema import ParallelConfig, RunConfig
from megatron_recipes.families.family import LAYER, MTP_LAYER

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")  # one key per MTP layer (never stacked)
_EXPERTS = ".experts.experts."


@dataclass(frozen=True)
class Item:
    key: str  # dist-checkpoint key
    canonical: str  # family-table key: ``decoder.layers.<name>`` / ``mtp.layers.<name>`` without a layer number
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]  # where this item starts in the global tensor
    prepend: int  # leading index axes (layer, expert) of the global tensor
    dtype: torch.dtype
    layer: Optional[int]
    expert: Optional[int]

    @property
    def shape(self) -> Tuple[int, ...]:
        """The tensor itself, without the index axes."""
        return self.global_shape[self.prepend :]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def label(self) -> str:
        where = [f"layer {self.layer}"] if self.layer is not None else []
        where += [f"expert {self.expert}"] if self.expert is not None else []
        return f"{self.canonical}" + (f" ({', '.join(where)})" if where else "")


def _describe(sh, num_layers: int) -> Tuple[str, Optional[int], Optional[int], int]:
    """canonical key, layer, expert and prepend count of one ShardedTensor (an MTP layer's layer counts on after
    the ``num_layers`` decoder layers: families/family.py)."""
    key, offset, prepend = sh.key, sh.global_offset, sh.prepend_axis_num
    layer = expert = None
    axis = 0
    match, mtp = _PER_LAYER.match(key), _MTP_LAYER.match(key)
    if mtp:
        layer, canonical = num_layers + int(mtp.group(1)), MTP_LAYER + mtp.group(2)
    elif match:
        layer, canonical = int(match.group(1)), LAYER + match.group(2)
    elif key.startswith(LAYER):
        canonical = key
        layer, axis = offset[0], 1
    else:
        canonical = key
    if _EXPERTS in key and prepend > axis:
        expert = offset[axis]
    return canonical, layer, expert, prepend


def _meta_config(cfg: RunConfig) -> RunConfig:
    """TP=PP=EP=1 in one rank, vocabulary padded as the target layout pads it."""
    m = cfg.model
    multiple = max(1, m.make_vocab_size_divisible_by) * max(1, cfg.parallel.tp)
    model = dataclasses.replace(m, make_vocab_size_divisible_by=multiple)
    cluster = dataclasses.replace(cfg.cluster, nodes=1, gpus_per_node=1, nvlink_domain=1)
    train = dataclasses.replace(cfg.train, global_batch_size=1, micro_batch_size=1)
    return dataclasses.replace(cfg, model=model, parallel=ParallelConfig(), cluster=cluster, train=train)


@dataclass
class Layout:
    """What a weights-only checkpoint of the model holds, as megatron-core and our engine would save it."""

    items: List[Item]  # tensors
    objects: Dict[str, object]  # ShardedObjects (``_extra_state``) by their dist-checkpoint key
    common: Dict[str, object]  # megatron-core's common.pt


def checkpoint_layout(cfg: RunConfig, state: Optional[Dict[str, object]] = None) -> Layout:
    """Every tensor of ``cfg.model``'s checkpoint at ``cfg.parallel``'s vocabulary padding, in model order.

    The state dict is exactly what ``checkpoint.save`` stores for weights only (``checkpoint.weights_state``:
    same ``sharded_state_dict`` metadata, same top-level keys), split by megatron-core's own ``save_preprocess``.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    from megatron_recipes.models.builder import build_gpt_model
    from megatron_recipes.models.transformer_config import build_transformer_config
    from megatron_recipes.runtime.distributed import init_model_parallel, shutdown

    meta = _meta_config(cfg)
    init_model_parallel(meta)
    try:
        config = build_transformer_config(meta, use_te=False, cpu_init=True)
        config.perform_initialization = False
        with torch.device("meta"):
            model = build_gpt_model(meta, config=config, use_te=False)
            sharded = checkpoint.weights_state([model], state or {"step": 0}, cfg)
            sharded_part, common = save_preprocess(sharded, validate_access_integrity=False)
        grouped: Dict[Tuple[str, Tuple[int, ...]], Item] = {}
        objects: Dict[str, object] = {}
        for sh in nested_values(sharded_part):
            if isinstance(sh, ShardedObject):
                objects[sh.unique_key] = sh.data  # TE/local ``_extra_state``: nothing to convert
                continue
            if not isinstance(sh, ShardedTensor):
                continue
            canonical, layer, expert, prepend = _describe(sh, meta.model.num_layers)
            index = tuple(sh.global_offset[:prepend])
            item = Item(
                key=sh.key,
                canonical=canonical,
                global_shape=tuple(sh.global_shape),
                offset=index + (0,) * (len(sh.global_shape) - prepend),
                prepend=prepend,
                dtype=sh.dtype,
                layer=layer,
                expert=expert,
            )
            grouped.setdefault((sh.key, index), item)
        return Layout(items=list(grouped.values()), objects=objects, common=common)
    finally:
        shutdown()
