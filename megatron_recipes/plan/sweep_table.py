"""``plan -m``: one row per sweep combination (layout, memory per GPU, step time), side by side.

Each row is ``plan``'s own judgement of that combination (the same rules, memory and step-time models);
a combination that breaks a rule is a row naming the rules, so a sweep over layouts shows which ones
exist at all next to which ones are fast.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from rich.console import Console

from megatron_recipes.config.sweep import Combination

MEMORY_RULE = "memory.fits"


def _layout(layout: Dict[str, Any]) -> str:
    parts = [f"{k}={layout[k]}" for k in ("tp", "pp", "vpp", "cp", "ep", "dp") if layout.get(k) not in (None, 1)]
    return " ".join(parts) or "one rank"


def sweep_rows(recipe: str, combinations: Sequence[Combination]) -> List[Dict[str, Any]]:
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.plan.search import PLAN_RULES
    from megatron_recipes.plan.summary import build_plan
    from megatron_recipes.validation.validate import validate

    rows = []
    for combination in combinations:
        cfg = compose_recipe(recipe, combination.overrides)
        violations = validate(cfg, rules=PLAN_RULES)
        row: Dict[str, Any] = {"combination": combination.name, "overrides": combination.chosen,
                               "valid": not violations, "broken": sorted({v.rule_id for v in violations})}
        if all(v.rule_id == MEMORY_RULE for v in violations):  # plan still prints a plan that only overflows memory
            plan = build_plan(cfg, recipe)
            memory, time = plan["memory"], plan["step_time"]
            row.update(layout=_layout(plan["layout"]), world_size=plan["layout"]["world_size"],
                       memory_gb=memory["worst_total_gb"], capacity_gb=memory["capacity_gb"], fits=memory["fits"],
                       step_s=time["step_s"], tokens_per_s_per_gpu=time["tokens_per_s_per_gpu"], mfu=time["model_mfu"])
        rows.append(row)
    return rows


def render_sweep(rows: Sequence[Dict[str, Any]], recipe: str, console: Console) -> None:
    from rich.table import Table

    table = Table(title=f"plan of {recipe}: {len(rows)} combinations")
    for column in ("combination", "layout", "GPUs", "memory/GPU", "fits", "step", "tokens/s/GPU", "MFU", "rules broken"):
        table.add_column(column, justify="right" if column in ("GPUs", "memory/GPU", "step", "tokens/s/GPU", "MFU") else "left")
    for r in rows:
        planned = "memory_gb" in r
        table.add_row(
            r["combination"], r.get("layout", "-"), str(r.get("world_size", "-")),
            f"{r['memory_gb']:.1f} / {r['capacity_gb']:.0f} GB" if planned else "-",
            ("yes" if r["fits"] else "NO") if planned else "-",
            f"{r['step_s']:.2f} s" if planned else "-",
            f"{r['tokens_per_s_per_gpu']:,.0f}" if planned else "-",
            f"{r['mfu']:.1%}" if planned and r.get("mfu") is not None else "-",
            ", ".join(r["broken"]) or "-",
        )
    console.print(table)
