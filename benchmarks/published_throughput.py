"""Every row of the published Megatron-Bridge throughput table against `plan`'s estimate.

    python benchmarks/published_throughput.py

Prints, per row: system, model, precision, GPUs, the published tokens/s/GPU, our estimate, their ratio,
our uncertainty band, the memory verdict (or why the row cannot be planned yet), the largest terms of
the step where the ratio leaves +/-20%, the share of the EP all-to-all hidden behind computation where the
run overlaps it, and what the published run used that the plan does not model. The constants were calibrated on the DGX-H100 rows only; the other systems' rows show
how well the model generalises.
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
    dominant = ", ".join(f"{k} {share:.0%}" for k, share in st.dominant(2))
    return {"row": row, "estimate": est, "ratio": est / row.tokens_per_s_per_gpu, "spread": st.spread,
            "memory_gb": mem.worst.total / 1e9, "capacity_gb": mem.capacity / 1e9, "fits": mem.fits,
            "violations": violations, "ep_hidden": st.ep_hidden / st.ep_transfer if st.ep_transfer else None,
            "dominant": dominant, "note": "; ".join(pub.unmodelled(row)),
            "recompute": cfg.train.recompute_modules if cfg.train.recompute == "selective" else []}


def main() -> None:
    print(f"{'system':10} {'model':15} {'prec':6} {'GPUs':>5} {'published':>9} {'estimate':>9} {'ratio':>6} {'+/-':>5}  memory")
    for row in pub.load():
        r = evaluate(row)
        head = f"{row.system:10} {row.model:15} {row.precision:6} {row.gpus:5d} {row.tokens_per_s_per_gpu:9.0f}"
        if "estimate" not in r:
            print(f"{head} {'n/a':>9} {'':>6} {'':>5}  not planned: {r['note']}")
            continue
        verdict = "FITS" if r["fits"] else "DOES NOT FIT"
        rules = f" (rules: {', '.join(r['violations'])})" if r["violations"] else ""
        hidden = f"; EP all-to-all {r['ep_hidden']:.0%} hidden" if r["ep_hidden"] is not None else ""
        band = "" if abs(r["ratio"] - 1) <= 0.2 else f" OUTSIDE +/-20% (step: {r['dominant']})"
        unmodelled = f"; not modelled: {r['note']}" if r["note"] else ""
        hidden += f"; recomputes {', '.join(r['recompute'])}" if r["recompute"] else ""
        print(f"{head} {r['estimate']:9.0f} {r['ratio']:6.2f} {r['spread']:5.0%}  {verdict} "
              f"{r['memory_gb']:.1f}/{r['capacity_gb']:.0f} GB{rules}{band}{hidden}{unmodelled}")


if __name__ == "__main__":
    main()
