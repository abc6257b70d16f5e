"""PEFT in a training run: whether a recipe trains adapters, and putting them on the base model.

The base weights are loaded by the checkpoint package (``checkpoint.start_of(cfg, adapters_only=True)``
decides them with every other start weight); a PEFT run's checkpoints hold the adapters only (see
``megatron_recipes.checkpoint`` and ``AdapterModule``).
"""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig


def prepare_for_training(cfg: RunConfig, chunks) -> Optional["object"]:
    """For a PEFT recipe: ``apply_peft`` on the bare chunks, once the base weights are in them.

    Returns the ``PeftSummary`` (None for ``peft.method=none``).
    """
    from megatron_recipes.config import peft_methods as methods
    from megatron_recipes.peft.apply import apply_peft

    if methods.parse(cfg.peft.method).none:
        return None
    if not cfg.checkpoint.pretrained:
        raise RecipeError(
            f"peft.method={cfg.peft.method} needs checkpoint.pretrained (the base the adapters train on)",
            fix="set checkpoint.pretrained=<converted checkpoint>",
        )
    return apply_peft(chunks, cfg)


def peft_active(cfg: RunConfig) -> bool:
    from megatron_recipes.config import peft_methods as methods

    return not methods.why_not(cfg.peft.method) and not methods.parse(cfg.peft.method).none
