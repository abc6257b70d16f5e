"""What a model family's mapping file declares, and how the engine finds the right one.

A family is data: HF architecture names, the HF config <-> ModelConfig functions, and a name table from
megatron-core's checkpoint keys (TE naming, layer index dropped: ``decoder.layers.<name>``) to typed
transforms over HF tensor names with ``{layer}``/``{expert}`` placeholders. The tables live in the
top-level ``conversion/`` folder, one small file per family.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ModelConfig
from megatron_recipes.convert.transforms import Transform

LAYER = "decoder.layers."


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    architectures: Tuple[str, ...]  # HF ``architectures`` this file converts
    model_type: str  # HF ``model_type`` written on export
    weights: Mapping[str, Transform]  # canonical megatron key -> transform
    config_from_hf: Callable[[Any], Dict[str, Any]]  # HF config object -> ModelConfig fields
    config_to_hf: Callable[[ModelConfig], Dict[str, Any]]  # ModelConfig -> HF config kwargs
    flags_from_hf: Callable[[Any], Dict[str, Any]] = lambda hf: {}  # per-model switches the transforms read
    ignored_hf: Tuple[str, ...] = (r".*rotary_emb\.inv_freq$",)  # HF tensors that are not weights
    ignored_from_hf: Callable[[Any], Tuple[str, ...]] = lambda hf: ()  # model-dependent skips (e.g. MTP layers)
    notes: str = ""

    def transform(self, canonical_key: str) -> Transform:
        try:
            return self.weights[canonical_key]
        except KeyError:
            raise RecipeError(
                f"family {self.name!r} has no mapping for megatron tensor {canonical_key}",
                fix=f"add it to conversion/{self.name}.py (this model uses a feature the mapping does not cover)",
            ) from None

    def ignored(self, hf) -> Tuple[str, ...]:
        """Patterns of HF tensors this family deliberately does not convert."""
        return self.ignored_hf + tuple(self.ignored_from_hf(hf))


def layer_table(entries: Mapping[str, Transform]) -> Dict[str, Transform]:
    """Prefix a table of per-layer entries with ``decoder.layers.``."""
    return {LAYER + k: v for k, v in entries.items()}


def hf_layer(template: str) -> str:
    """HF per-layer names: ``model.layers.{layer}.<template>``."""
    return "model.layers.{layer}." + template


@dataclass
class _Registry:
    families: Dict[str, Family] = field(default_factory=dict)
    loaded: bool = False


_REGISTRY = _Registry()


def _load() -> Dict[str, Family]:
    if not _REGISTRY.loaded:
        package = importlib.import_module("megatron_recipes._conversion")
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"megatron_recipes._conversion.{info.name}")
            family = getattr(module, "FAMILY", None)
            if isinstance(family, Family):
                _REGISTRY.families[family.name] = family
        _REGISTRY.loaded = True
    return _REGISTRY.families


def all_families() -> Dict[str, Family]:
    return dict(_load())


def by_name(name: str) -> Family:
    families = _load()
    if name not in families:
        raise RecipeError(f"no conversion mapping for model.family={name!r}", fix=f"known families: {', '.join(sorted(families))}")
    return families[name]


def by_architecture(architectures: Optional[Sequence[str]], model_type: Optional[str]) -> Family:
    families = _load()
    for arch in architectures or ():
        for family in families.values():
            if arch in family.architectures:
                return family
    known = sorted(a for f in families.values() for a in f.architectures)
    raise RecipeError(
        f"unknown architecture {list(architectures or [])} (model_type={model_type!r})",
        fix=f"convertible architectures: {', '.join(known)}",
    )
