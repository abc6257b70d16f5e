"""Every row of the published Megatron-Bridge throughput table against `plan`'s estimate.

    python benchmarks/published_throughput.py

Prints, per row: system, model, precision, GPUs, the published tokens/s/GPU, our estimate, their ratio,
our uncertainty band and the memory verdict (or why the row cannot be planned yet). The constants were
calibrated on the DGX-H100 rows only; the other systems' rows show how well the model generalises.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_recipes.config.compose import compose_recipe  # noqa: E402
from megatron_recipes.estimate.memory import estimate_memory  # noqa: E402
from megatron_recipes.estimate.steptime import estimate_step_time  # noqa: E402
from megatron_recipes.validation.validate import validate  # noqa: E402
from tests import published_support as pub  # noqa: E402


def evaluate(row: pub.Row) -> dict:
    base = compose_recipe(pub.RECIPES[row.model], [])
    ov, why = pub.overrides(row, base.model.num_layers)
    if ov is None:
        return {"row": row, "note": why}
    cfg = compose_recipe(pub.RECIPES[row.model], ov)
    violations = [v.rule_id for v in validate(cfg)]
    mem = estimate_memory(cfg)
    st = estimate_step_time(cfg)
    est = st.tokens_per_s_per_gpu
    return {"row": row, "estimate": est, "ratio": est / row.tokens_per_s_per_gpu, "spread": st.spread,
            "memory_gb": mem.worst.total / 1e9, "capacity_gb": mem.capacity / 1e9, "fits": mem.fits,
            "violations": violations, "note": ""}


def main() -> None:
    print(f"{'system':10} {'model':14} {'prec':6} {'GPUs':>5} {'published':>9} {'estimate':>9} {'ratio':>6} {'+/-':>5}  memory")
    for row in pub.load():
        r = evaluate(row)
        head = f"{row.system:10} {row.model:14} {row.precision:6} {row.gpus:5d} {row.tokens_per_s_per_gpu:9.0f}"
        if "estimate" not in r:
            print(f"{head} {'n/a':>9} {'':>6} {'':>5}  not planned: {r['note']}")
            continue
        verdict = "FITS" if r["fits"] else "DOES NOT FIT"
        rules = f" (rules: {', '.join(r['violations'])})" if r["violations"] else ""
        print(f"{head} {r['estimate']:9.0f} {r['ratio']:6.2f} {r['spread']:5.0%}  {verdict} "
              f"{r['memory_gb']:.1f}/{r['capacity_gb']:.0f} GB{rules}")


if __name__ == "__main__":
    main()
