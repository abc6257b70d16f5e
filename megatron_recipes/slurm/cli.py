"""``megatron-recipes slurm render|submit <recipe> [overrides] [--out FILE] [--wait] [--dry-run] ...``

render: the sbatch script to stdout (or ``--out FILE``); submit: write it under ``<run.dir>/slurm/``
and ``sbatch`` it. ``--dry-run`` prints the exact sbatch/srun/per-node commands and touches nothing.
``--probe`` runs a quick all-reduce across every rank instead of training (a cluster smoke test);
``--skip-path-checks`` skips mount/image existence checks (rendering away from the cluster).
``submit -m key=a,b ...`` submits one job per combination, each in its own subfolder of ``run.dir``.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from megatron_recipes.cli_args import split_args, subcommand
from megatron_recipes.slurm.dryrun import describe
from megatron_recipes.slurm.launch_plan import build_plan
from megatron_recipes.slurm.script import render_script

USAGE = (
    "usage: megatron-recipes slurm render <recipe> [key=value ...] [--out FILE] [--dry-run] [--probe] [--skip-path-checks]\n"
    "       megatron-recipes slurm submit <recipe> [key=value ...] [--wait] [--dry-run] [--probe] [--skip-path-checks]"
)
_COMMON = {"dry-run": False, "probe": False, "skip-path-checks": False}
FLAGS = {"render": {**_COMMON, "out": True}, "submit": {**_COMMON, "wait": False}}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    picked = subcommand(argv, list(FLAGS), USAGE, "slurm action")
    if picked is None:
        return 0
    action, rest = picked
    from megatron_recipes.config.sweep import expand, take_multirun

    rest, multirun = take_multirun(rest)
    args = split_args(rest, f"megatron-recipes slurm {action}", flags=FLAGS[action])
    sweep = expand(args.overrides, multirun)
    if sweep is not None:
        return _sweep(action, args, sweep)
    plan = build_plan(args.recipe, args.overrides, probe=bool(args.flags.get("probe")),
                      check_paths=not args.flags.get("skip-path-checks"))
    out_path = args.flags.get("out")
    if args.flags.get("dry-run"):
        print(describe(plan, str(out_path) if out_path else plan.script_path), end="")
        return 0
    if action == "render":
        text = render_script(plan)
        if out_path:
            from megatron_recipes.slurm.submit import write_script

            write_script(text, str(out_path))
            print(f"wrote {out_path}", file=sys.stderr)
        else:
            print(text, end="")
        return 0
    from megatron_recipes.slurm.submit import submit

    result = submit(plan, wait=bool(args.flags.get("wait")))
    return int(result.exit_code or 0)


def _sweep(action: str, args, combinations) -> int:
    """``submit -m``: one job per combination, each with its own run dir (every plan built, so checked, first)."""
    from megatron_recipes.config.errors import RecipeError

    if action == "render":
        raise RecipeError("slurm render writes one script; a sweep is one job per combination",
                          fix="use `megatron-recipes slurm submit <recipe> -m ... [--dry-run]`, or render one combination")
    probe, check = bool(args.flags.get("probe")), not args.flags.get("skip-path-checks")
    plans = []
    for combination in combinations:
        base = build_plan(args.recipe, combination.overrides, probe=probe, check_paths=check).cfg.run.dir
        plans.append((combination, build_plan(args.recipe, combination.with_run_dir(base), probe=probe, check_paths=check)))
    codes = []
    for number, (combination, plan) in enumerate(plans, 1):
        print(f"# sweep job {number}/{len(plans)}: {combination.name}", flush=True)
        if args.flags.get("dry-run"):
            print(describe(plan, plan.script_path), end="")
            continue
        from megatron_recipes.slurm.submit import submit

        codes.append(int(submit(plan, wait=bool(args.flags.get("wait"))).exit_code or 0))
    failed = [c for c in codes if c]
    return failed[0] if failed else 0
