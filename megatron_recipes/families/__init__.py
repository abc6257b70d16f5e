"""Model families: one small declarative HF <-> Megatron mapping per family, and the lookup by name.

Each family is one module here named after it (``llama.py`` declares ``FAMILY`` with ``name="llama"``):
its HF config <-> ``ModelConfig`` functions, its tensor name table, and the tiny HF config the tests build
a random model from. What the modules share is declared beside them: ``family`` (the ``Family`` record),
``transforms`` (typed tensor transforms) and ``hf_config`` (HF config helpers); the conversion engine in
``convert/`` reads families and is never imported by them.

The list of families is explicit and lives once, in the rule table (``validation/rules_model.FAMILIES``, the
allowed values of ``model.family``), so a recipe naming a family without a mapping fails validation
before it trains. Adding a family: its module here, its name in that list, and a model YAML under
``recipes/model/`` to train it (any recipe composes it with ``model=<name>``); the conversion tests
loop over every listed family on their own.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Dict, Optional, Sequence

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.families.family import Family
from megatron_recipes.validation.rules_model import FAMILIES

__all__ = ["FAMILIES", "Family", "all_families", "by_architecture", "by_name"]


@lru_cache(maxsize=None)
def _load() -> Dict[str, Family]:
    """Import the module of every listed family; its ``FAMILY`` must carry the module's name."""
    out: Dict[str, Family] = {}
    for name in FAMILIES:
        family = getattr(importlib.import_module(f"{__name__}.{name}"), "FAMILY", None)
        if not isinstance(family, Family) or family.name != name:
            raise RecipeError(
                f"megatron_recipes/families/{name}.py does not declare FAMILY = Family(name={name!r}, ...)",
                fix="every name in validation/rules_model.FAMILIES needs a module of that name declaring its FAMILY",
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
