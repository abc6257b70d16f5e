"""``train -m``: a sweep's runs on this machine, one after another, each in its own run dir.

Why every combination is validated before the first starts: a rule one of them breaks would otherwise
show only after the others trained for an hour. Why each run is its own ``train`` process: a run's
process groups, seeds and megatron-core globals must not meet the next one's. A run that fails does not
stop the others (each stands alone; the table at the end shows each one's exit code); Ctrl-C stops the sweep.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import List, Sequence

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.sweep import Combination

INTERRUPTED = 130


@dataclass
class Planned:
    combination: Combination
    overrides: List[str]  # with its own run.dir
    run_dir: str


def plan_runs(recipe: str, combinations: Sequence[Combination]) -> List[Planned]:
    """Each combination composed with its run dir and validated, before any starts."""
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.training.preflight import NothingToTrain, validate

    planned = []
    for combination in combinations:
        base = compose_recipe(recipe, combination.overrides).run.dir
        overrides = combination.with_run_dir(base)
        cfg = compose_recipe(recipe, overrides)
        try:
            validate(cfg, recipe)
        except NothingToTrain:
            pass  # already trained: its own start says so and exits 0
        except RecipeError as exc:
            raise RecipeError(f"sweep run {combination.name}: {exc.message}", fix=exc.fix) from None
        planned.append(Planned(combination, overrides, cfg.run.dir))
    return planned


def run_sweep(recipe: str, combinations: Sequence[Combination]) -> int:
    """Train every combination; 0 when all succeeded, else the first failure's exit code."""
    planned = plan_runs(recipe, combinations)
    print(f"sweep: {len(planned)} runs of {recipe}, one after another", flush=True)
    codes: List[int] = []
    for number, run in enumerate(planned, 1):
        print(f"\n=== sweep run {number}/{len(planned)}: {run.combination.name} -> {run.run_dir}", flush=True)
        command = [sys.executable, "-m", "megatron_recipes.cli", "train", recipe, *run.overrides]
        try:
            code = subprocess.call(command)
        except KeyboardInterrupt:
            code = INTERRUPTED
        codes.append(code)
        if code == INTERRUPTED:
            break
    print(f"\nsweep of {recipe}:")
    for run, code in zip(planned, codes + [None] * (len(planned) - len(codes))):
        state = "not started (interrupted)" if code is None else ("ok" if code == 0 else f"failed (exit {code})")
        print(f"  {run.combination.name:<40} {state:<26} {run.run_dir}")
    failed = [c for c in codes if c != 0]
    return failed[0] if failed else 0
