"""How a base parallel linear is split and what it communicates, read from the module itself.

Adapters and the NF4 base must match the base's split exactly, so everything they need (column or row,
local shape, TP group, sequence parallel, whether the layer communicates at all or leaves that to the MoE
dispatcher, bias handling, a fused input norm) is collected here once, for megatron-core's local
``ColumnParallelLinear``/``RowParallelLinear`` and for the Transformer Engine classes of its TE spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LinearLayout:
    kind: str  # "column" (output features split over TP) | "row" (input features split over TP)
    in_local: int
    out_local: int
    tp_size: int  # ranks the layer is split over (1 when it does not split)
    tp_group: Optional[torch.distributed.ProcessGroup]
    communicates: bool  # False for expert layers: the MoE dispatcher gathers/reduces instead
    sequence_parallel: bool
    is_expert: bool
    skip_bias_add: bool  # bias returned to the caller instead of added
    engine: str  # "local" | "te" | "nf4"
    fused_norm: bool  # TE LayerNormColumnParallelLinear: the input norm runs inside the layer
    gather_output: bool = False
    input_is_parallel: bool = True

    @property
    def in_full(self) -> int:
        return self.in_local * self.tp_size if self.kind == "row" else self.in_local

    @property
    def out_full(self) -> int:
        return self.out_local * self.tp_size if self.kind == "column" else self.out_local


def _te_classes():
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:  # TE absent or broken: no TE modules can exist in the model either
        return ()
    names = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear")
    return tuple(c for c in (getattr(te_ext, n, None) for n in names) if isinstance(c, type))


def is_te_linear(module: torch.nn.Module) -> bool:
    classes = _te_classes()
    return bool(classes) and isinstance(module, classes)


def supported_linear(module: torch.nn.Module) -> bool:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_recipes.peft.nf4_linear import NF4ParallelLinear

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear, NF4ParallelLinear)) or is_te_linear(module)


def _group_size(group) -> int:
    return group.size() if group is not None else 1


def layout_of(module: torch.nn.Module) -> LinearLayout:
    """The layout of a supported base linear (callers check ``supported_linear`` first)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_recipes.peft.nf4_linear import NF4ParallelLinear

    if isinstance(module, NF4ParallelLinear):
        return module.layout
    out_local, in_local = module.weight.shape
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        column = isinstance(module, ColumnParallelLinear)
        tp = _group_size(module.tp_group)
        return LinearLayout(
            kind="column" if column else "row",
            in_local=in_local,
            out_local=out_local,
            tp_size=tp,
            tp_group=module.tp_group,
            communicates=not module.explicit_expert_comm,
            sequence_parallel=bool(module.sequence_parallel),
            is_expert=bool(module.is_expert),
            skip_bias_add=bool(module.skip_bias_add),
            engine="local",
            fused_norm=False,
            gather_output=bool(getattr(module, "gather_output", False)),
            input_is_parallel=bool(getattr(module, "input_is_parallel", True)),
        )
    return _te_layout(module, out_local, in_local)


def _te_layout(module, out_local: int, in_local: int) -> LinearLayout:
    from megatron.core.extensions import transformer_engine as te_ext

    column = not isinstance(module, te_ext.TERowParallelLinear)
    if module.parallel_mode is None:  # expert layer (explicit comm) or a duplicated layer
        from megatron_recipes.config.errors import RecipeError

        raise RecipeError(
            f"{type(module).__name__} without its own tensor-parallel split (an expert or duplicated layer) "
            "cannot take an adapter under the Transformer Engine spec",
            fix="leave expert_fc1/expert_fc2 out of peft.target_modules on GPU runs",
        )
    communicates = True
    tp = module.tp_size
    return LinearLayout(
        kind="column" if column else "row",
        in_local=in_local,
        out_local=out_local,
        tp_size=tp,
        tp_group=module.tp_group,
        communicates=communicates,
        sequence_parallel=bool(module.sequence_parallel),
        is_expert=bool(getattr(module, "is_expert", False)),
        skip_bias_add=bool(getattr(module, "te_return_bias", False)),
        engine="te",
        fused_norm=isinstance(module, te_ext.TELayerNormColumnParallelLinear),
    )
