"""Which modules of a model chunk an adapter can go on, under the names recipes use.

Names are megatron-core's module names: ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``
(dense MLPs and shared experts), and ``expert_fc1``/``expert_fc2`` for routed experts. Parameter
initialisation and export need a layout-free identity for each module, so every target also gets a
canonical name with global layer (and expert) indices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, List

import torch

from megatron_recipes.peft.layout import supported_linear

KNOWN_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "expert_fc1", "expert_fc2")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"experts\.local_experts\.(\d+)\.")


@dataclass
class Target:
    path: str  # module path inside the chunk (local indices)
    canonical: str  # global indices: layers.<L>.<...>, experts.<E>
    kind: str  # one of KNOWN_TARGETS (or another linear's own name)
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
    return sorted(kinds, key=lambda k: (KNOWN_TARGETS.index(k) if k in KNOWN_TARGETS else 99, k))


def attention_modules(chunk: torch.nn.Module) -> Iterator[tuple]:
    """``(canonical layer name, attention module)`` for every self-attention with a ``core_attention``."""
    for path, module in chunk.named_modules():
        if path.endswith("self_attention") and hasattr(module, "core_attention") and _LAYER.search(path + "."):
            yield canonical_name(chunk, path), module
