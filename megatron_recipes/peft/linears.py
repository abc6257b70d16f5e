"""What adapters share about the base model's linears: their split, which ones are targets, their keys.

* Layout: how a base parallel linear is split and what it communicates, read from the module itself.
  Adapters and the NF4 base must match the base's split exactly, so everything they need (column or
  row, local shape, TP group, sequence parallel, whether the layer communicates at all or leaves that to
  the MoE dispatcher, bias handling, a fused input norm) is collected here once, for megatron-core's
  local ``ColumnParallelLinear``/``RowParallelLinear`` and for the Transformer Engine classes of its TE spec.
* Targets: which modules of a model chunk an adapter can go on, under the names recipes use
  (megatron-core's ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` for dense MLPs and
  shared experts, ``expert_fc1``/``expert_fc2`` for routed experts), each with a canonical name with
  global layer (and expert) indices, the layout-free identity that initialisation and export need.
* Keys: wrappers hold the base as a child named ``base``; saving writes the base's entries under the
  wrapper's own prefix and a load pre-hook maps them back, so checkpoints and weight loaders see one key
  set whether or not a layer is wrapped.
* Initialisation that does not depend on the parallel layout: each adapter tensor is drawn whole from a
  generator seeded by the run seed and the parameter's layout-free name, then each rank keeps its shard,
  so TP=1 and TP=2 (or PP=1 and PP=2) runs start from identical adapters and their losses compare step
  by step.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_recipes.config.peft_methods import TARGETS


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

    from megatron_recipes.peft.qlora import NF4ParallelLinear  # qlora builds on this module's layout

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear, NF4ParallelLinear)) or is_te_linear(module)


def _group_size(group) -> int:
    return group.size() if group is not None else 1


def _layout(module, column: bool, out_local: int, in_local: int, tp: int, **engine_specific: Any) -> LinearLayout:
    """What every engine's linear states the same way: split kind, local shape, TP group, sequence parallelism."""
    return LinearLayout(
        kind="column" if column else "row",
        in_local=in_local,
        out_local=out_local,
        tp_size=tp,
        tp_group=module.tp_group,
        sequence_parallel=bool(module.sequence_parallel),
        **engine_specific,
    )


def layout_of(module: torch.nn.Module) -> LinearLayout:
    """The layout of a supported base linear (callers check ``supported_linear`` first)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_recipes.peft.qlora import NF4ParallelLinear

    if isinstance(module, NF4ParallelLinear):
        return module.layout
    out_local, in_local = module.weight.shape
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return _layout(
            module,
            isinstance(module, ColumnParallelLinear),
            out_local,
            in_local,
            _group_size(module.tp_group),
            communicates=not module.explicit_expert_comm,
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
    return _layout(
        module,
        column,
        out_local,
        in_local,
        module.tp_size,
        communicates=True,
        is_expert=bool(getattr(module, "is_expert", False)),
        skip_bias_add=bool(getattr(module, "te_return_bias", False)),
        engine="te",
        fused_norm=isinstance(module, te_ext.TELayerNormColumnParallelLinear),
    )


# --- targets: the adaptable linears of a chunk -------------------------------------------------------

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"experts\.local_experts\.(\d+)\.")


@dataclass
class Target:
    path: str  # module path inside the chunk (local indices)
    canonical: str  # global indices: layers.<L>.<...>, experts.<E>
    kind: str  # one of TARGETS (or another linear's own name)
    layer: int  # global 0-based layer index
    module: torch.nn.Module
    parent: torch.nn.Module
    attr: str


def target_kind(path: str) -> str:
    leaf = path.rsplit(".", 1)[-1]
    if ".experts.local_experts." in f".{path}" and leaf in ("linear_fc1", "linear_fc2"):
        return "expert_" + leaf[len("linear_") :]
    return leaf


def _global_layer(chunk: torch.nn.Module, local: int) -> int:
    layer = chunk.decoder.layers[local]
    return int(layer.layer_number) - 1


def canonical_name(chunk: torch.nn.Module, path: str) -> str:
    """``decoder.layers.<local>`` -> ``layers.<global>``; ``local_experts.<e>`` -> ``experts.<global e>``."""
    match = _LAYER.search(path)
    if not match:
        return path
    layer = _global_layer(chunk, int(match.group(1)))
    name = _LAYER.sub(f"layers.{layer}.", path, count=1)
    expert = _EXPERT.search(name)
    if expert:
        experts_module = chunk.get_submodule(path[: path.index("local_experts.")].rstrip("."))
        offset = experts_module.ep_group.rank() * experts_module.num_local_experts if hasattr(experts_module, "ep_group") else 0
        name = _EXPERT.sub(f"experts.{offset + int(expert.group(1))}.", name, count=1)
    return name


def iter_linears(chunk: torch.nn.Module) -> Iterator[Target]:
    """Every adaptable linear inside the chunk's transformer layers (not embeddings or the output layer)."""
    for path, module in chunk.named_modules():
        match = _LAYER.search(path)
        if not match or not supported_linear(module):
            continue
        parent_path, attr = path.rsplit(".", 1)
        yield Target(
            path=path,
            canonical=canonical_name(chunk, path),
            kind=target_kind(path),
            layer=_global_layer(chunk, int(match.group(1))),
            module=module,
            parent=chunk.get_submodule(parent_path),
            attr=attr,
        )


def find_targets(chunks: List[torch.nn.Module], names: List[str]) -> Dict[str, List[Target]]:
    """Targets per requested name (an empty list: this rank's layers hold none of that kind)."""
    wanted = set(names)
    found: Dict[str, List[Target]] = {n: [] for n in names}
    for chunk in chunks:
        for target in iter_linears(chunk):
            if target.kind in wanted:
                found[target.kind].append(target)
    return found


def present_kinds(chunks: List[torch.nn.Module]) -> List[str]:
    kinds = {t.kind for chunk in chunks for t in iter_linears(chunk)}
    return sorted(kinds, key=lambda k: (TARGETS.index(k) if k in TARGETS else 99, k))


def attention_modules(chunk: torch.nn.Module) -> Iterator[tuple]:
    """``(canonical layer name, attention module)`` for every self-attention with a ``core_attention``."""
    for path, module in chunk.named_modules():
        if path.endswith("self_attention") and hasattr(module, "core_attention") and _LAYER.search(path + "."):
            yield canonical_name(chunk, path), module


# --- keys: a wrapped base keeps the keys it had ----------------------------------------------------

def keep_child_keys(wrapper: torch.nn.Module, child: str = "base", own: Tuple[str, ...] = ()) -> None:
    """Register the load-side mapping: ``<prefix>x`` -> ``<prefix><child>.x`` for keys not in ``own``."""

    def hook(state_dict, prefix, *args, **kwargs):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix) :]
            if rest.startswith(f"{child}.") or any(rest.startswith(o) for o in own):
                continue
            state_dict[f"{prefix}{child}.{rest}"] = state_dict.pop(key)

    wrapper._register_load_state_dict_pre_hook(hook)


# --- layout-free initialisation -------------------------------------------------------------------

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
