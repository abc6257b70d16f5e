"""Model families: one small declarative HF <-> Megatron mapping per family, and the lookup by name.

Each family is one module here named after it (``llama.py`` declares ``FAMILY`` with ``name="llama"``):
its HF config <-> ``ModelConfig`` functions, its tensor name table, and the tiny HF config the tests build
a random model from. What the modules share is declared beside them: ``family`` (the ``Family`` record),
``transforms`` (typed tensor transforms), ``hf_config`` (HF config helpers) and private ``_*`` modules;
the conversion engine in ``convert/`` reads families and is never imported by them.

The list of families is this package's modules other than those shared ones (``FAMILIES``, found without
importing them, so reading the list costs no torch import); it is the allowed values of ``model.family``
in the rule table, so a recipe naming a family without a mapping fails validation before it trains.
Adding a family is its module here and a model YAML under ``recipes/model/`` (plus a named recipe under
``recipes/`` if you want one); the conversion tests loop over every family on their own.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from typing import TYPE_CHECKING, Dict, Optional, Sequence

from megatron_recipes.config.errors import RecipeError

if TYPE_CHECKING:  # imported where used: reading the list must not import torch
    from megatron_recipes.families.family import Family

SHARED = ("family", "hf_config", "transforms")  # what the family modules share; not families themselves
FAMILIES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in SHARED and not m.name.startswith("_")))

__all__ = ["FAMILIES", "all_families", "by_architecture", "by_name"]


@lru_cache(maxsize=None)
def _load() -> Dict[str, Family]:
    """Import the module of every family; its ``FAMILY`` must carry the module's name."""
    from megatron_recipes.families.family import Family

    out: Dict[str, Family] = {}
    for name in FAMILIES:
        family = getattr(importlib.import_module(f"{__name__}.{name}"), "FAMILY", None)
        if not isinstance(family, Family) or family.name != name:
            raise RecipeError(
                f"megatron_recipes/families/{name}.py does not declare FAMILY = Family(name={name!r}, ...)",
                fix="a family module declares its FAMILY; a shared helper module's name starts with '_'",
            )
        out[name] = family
    return out


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
