"""`megatron-recipes plan <recipe> [overrides] [--search [--top N]] [--picture out.png] [--show-config] [--json]
[--all-groups]`, `megatron-recipes plan <recipe> -m key=a,b ...` (a sweep: one row per combination), and
`megatron-recipes plan --rules` (the validation rule table).

Prints the layout, megatron-core's rank -> group map with node / NVLink-domain marks, the per-GPU
memory estimate with its verdict, and a step-time estimate, without starting a process group or
touching a GPU. A recipe that breaks any rule exits non-zero with every violation and prints no plan;
one that only fails the memory rule prints its plan (so the overshoot can be read) and then fails.
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

from rich.console import Console

from megatron_recipes.cli_args import hydra_cfg, positive_int, split_args
from megatron_recipes.config.compose import compose_recipe, to_yaml
from megatron_recipes.config.errors import RecipeError, ValidationError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.plan.search import INPUT_RULES, PLAN_RULES  # `plan` names the rules it did not check
from megatron_recipes.validation.validate import validate

PROG = "megatron-recipes plan"
FLAGS = {"cfg": True, "search": False, "picture": True, "show-config": False, "json": False, "all-groups": False, "top": positive_int,
         "rules": False}
MEMORY_RULE = "memory.fits"


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 160, highlight=False)


def run_search(cfg: RunConfig, recipe: str, overrides: Sequence[str], top: int, as_json: bool, console: Console) -> int:
    from megatron_recipes.plan.report import render_search, search_rows
    from megatron_recipes.plan.search import search_layouts

    result = search_layouts(cfg, top=top, progress=True)  # a bar on a terminal, lines on stderr elsewhere
    if as_json:
        rows = search_rows(result, overrides)
        print(json.dumps({"recipe": recipe, "enumerated": result.enumerated, "screened": result.screened,
                          "rejected": dict(result.rejected), "layouts": rows}, indent=2))
    else:
        render_search(result, recipe, console, base_overrides=overrides)
    if not result.best:
        common = ", ".join(f"{k} ({n})" for k, n in result.rejected.most_common(4))
        why = f"; the fastest candidates broke: {common}" if common else f" ({result.screened} of {result.enumerated} fit)"
        raise RecipeError(
            f"no layout of {cfg.model.name} on {cfg.cluster.nodes} x {cfg.cluster.name} passes validation and fits{why}",
            fix="fix rules that do not depend on the layout (see `megatron-recipes plan <recipe>`), or add nodes "
            "(cluster.nodes=...), pick a larger-memory cluster, or lower the global batch / sequence length",
        )
    return 0


def print_rules(as_json: bool, console: Console) -> int:
    """Every rule of the one table (all scopes), with the scope that says which command judges it."""
    from rich.table import Table

    from megatron_recipes.validation.rules import RULES, SCOPES

    if as_json:
        print(json.dumps([{"id": r.id, "scope": r.scope, "fields": list(r.fields), "rule": r.message} for r in RULES], indent=2))
        return 0
    table = Table(title=f"validation rules ({len(RULES)})")
    for col in ("id", "scope", "fields", "rule"):
        table.add_column(col)
    for r in RULES:
        table.add_row(r.id, r.scope, ", ".join(r.fields), r.message)
    console.print(table)
    for name, what in SCOPES.items():
        console.print(f"{name}: {what}")
    return 0


def run_sweep(recipe: str, combinations, as_json: bool, console: Console) -> int:
    """``plan -m``: every combination's plan in one table; fails only when none of them passes."""
    from megatron_recipes.plan.sweep_table import render_sweep, sweep_rows

    rows = sweep_rows(recipe, combinations)
    if as_json:
        print(json.dumps({"recipe": recipe, "combinations": rows}, indent=2, default=str))
    else:
        render_sweep(rows, recipe, console)
    broken = [r["combination"] for r in rows if not r["valid"]]
    if len(broken) == len(rows):
        raise RecipeError(f"none of the {len(rows)} combinations passes validation (see the rules each breaks)",
                          fix=f"`{PROG} {recipe} <one combination>` prints each rule with its fix")
    if broken and not as_json:
        console.print(f"{len(broken)} of {len(rows)} combinations break rules: {', '.join(broken)}")
    return 0


def main(argv: Sequence[str]) -> int:
    from megatron_recipes.config.sweep import expand, take_multirun

    argv, multirun = take_multirun(argv)
    args = split_args(argv, PROG, flags=FLAGS, optional_positional=1)
    if args.flags.get("rules"):
        return print_rules(bool(args.flags.get("json")), _console())
    if not args.positional:
        raise RecipeError(f"{PROG}: missing recipe", fix=f"usage: {PROG} <recipe> [key=value ...] [--search] [--picture out.png]")
    recipe = args.recipe
    console = _console()
    as_json = bool(args.flags.get("json"))
    sweep = expand(args.overrides, multirun)
    if sweep is not None:
        return run_sweep(recipe, sweep, as_json, console)
    cfg = compose_recipe(recipe, args.overrides)
    if hydra_cfg(args.flags.get("cfg"), cfg):
        return 0
    if args.flags.get("show-config") and not as_json:
        console.print(to_yaml(cfg), markup=False)
    if args.flags.get("search"):
        return run_search(cfg, recipe, args.overrides, args.flags.get("top", 5), as_json, console)

    violations = validate(cfg, rules=PLAN_RULES)
    blocking = [v for v in violations if v.rule_id != MEMORY_RULE]
    if blocking:
        raise ValidationError(violations, recipe=recipe)

    from megatron_recipes.plan.summary import build_plan
    from megatron_recipes.plan.report import render_plan

    all_groups = bool(args.flags.get("all-groups"))
    plan = build_plan(cfg, recipe, all_groups=all_groups)
    if as_json:
        plan["valid"] = not violations
        print(json.dumps(plan, indent=2, default=str))
    else:
        render_plan(plan, console, all_groups=all_groups)
        console.print(f"not checked by plan (train checks them): {', '.join(INPUT_RULES)}")
    picture = args.flags.get("picture")
    if picture:
        from megatron_recipes.plan.picture import draw_layout

        path = draw_layout(cfg, str(picture), title=recipe)
        if not as_json:
            console.print(f"picture: {path}")
    if violations:
        raise ValidationError(violations, recipe=recipe)
    return 0
