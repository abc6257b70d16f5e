"""Recipe + overrides -> a validated ``LaunchPlan`` (the one thing render, dry-run and submit share).

``run.dir`` is made absolute here, against the folder the command runs in: the batch job, the
container's working directory and a requeued restart must all write to the same place.
"""

from __future__ import annotations

import os
from typing import Sequence

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.validation.rules import Host, select
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.validate import validate_or_raise
from megatron_recipes.config import container_flags as container
from megatron_recipes.slurm.commands import PROBE_MODULE, TRAIN_MODULE, LaunchPlan, default_python


def build_plan(
    recipe: str,
    overrides: Sequence[str] = (),
    *,
    probe: bool = False,
    check_paths: bool = True,
) -> LaunchPlan:
    """Compose, resolve paths, validate (recipe, input and launch rules, reported together); raises
    ValidationError/RecipeError."""
    return plan_for(compose_recipe(recipe, overrides), recipe, overrides, probe=probe, check_paths=check_paths)


def plan_for(cfg: RunConfig, recipe: str, overrides: Sequence[str] = (), *, probe: bool = False,
             check_paths: bool = True) -> LaunchPlan:
    """``build_plan`` for a config already composed (``recipe``/``overrides`` are echoed in the script)."""
    cfg.run.dir = os.path.abspath(os.path.expanduser(cfg.run.dir))
    validate_or_raise(cfg, recipe, rules=select(("recipe", "input", "launch")), host=Host(check_paths=check_paths))
    mounts = container.parse_mounts(cfg.cluster.container_mounts) if container.image_of(cfg.cluster) else []
    return LaunchPlan(
        cfg=cfg,
        recipe=recipe,
        overrides=tuple(overrides),
        module=PROBE_MODULE if probe else TRAIN_MODULE,
        python=default_python(cfg),
        mounts=mounts,
    )
