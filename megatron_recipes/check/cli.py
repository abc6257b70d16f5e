"""``megatron-recipes check <recipe> [overrides]``: prove a recipe's parallel layout on CPU ranks.

Shrinks the model (check/shrink.py), writes one step-0 seed checkpoint, trains a few steps at the recipe's
layout and on one rank from that seed, and compares the per-step losses and gradient norms; then resumes
the layout's checkpoint on one rank (resharding, optimizer state included) and compares the steps after
it. Megatron-FSDP checkpoints resume only at the layout that saved them (megatron-core 0.16.1), so there the
layout's weights are reloaded on one rank instead, next to the one-rank run's own weights of the same step,
and both continue from a fresh optimizer on the same batches. Exit 0: the layout is proven; 1: it trains differently from one rank (or a run failed); 2: recipe error.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_recipes import files
from megatron_recipes.check import compare  # ranks, runs: torch, imported once the check starts
from megatron_recipes.check.shrink import LAYERS_PER_CHUNK, Shrunk, shrink
from megatron_recipes.cli_args import split_args
from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

PROG = "megatron-recipes check"
FLAGS = {"max-ranks": int, "dir": True, "steps": int, "rtol": float, "timeout": int, "full-depth": False}
# Adam as SGD: beta1=0 and eps=1e4 make lr*g/(sqrt(v)+eps) equal to (lr/eps)*g within 1e-5, so float32
# rounding is added, not amplified (Adam's m/sqrt(v) would blow it up), through the recipe's own optimizer
# class (the distributed optimizer when the recipe uses it). clip_grad huge: the norm is computed
# across every model-parallel group and logged, but never clips.
OPTIMIZER = [
    "optimizer.name=adam", "optimizer.lr=1000.0", "optimizer.min_lr=1000.0", "optimizer.adam_beta1=0.0",
    "optimizer.adam_eps=10000.0", "optimizer.weight_decay=0.0", "optimizer.clip_grad=1.0e9",
    "optimizer.lr_warmup_iters=0", "optimizer.lr_warmup_fraction=null", "optimizer.lr_decay_style=constant",
    "optimizer.lr_decay_iters=null",
]
# The CPU lane trains in float32: the precision group and each of its fields, so that precision settings the
# recipe makes on top of its group (precision.fp8_param_gather=true, say) cannot outlive the swap.
FP32 = ["precision=fp32", "precision.params_dtype=fp32", "precision.fp8=null", "precision.fp8_param_gather=false",
        "precision.fp4=null", "precision.grad_reduce_in_fp32=true"]
QUIET = ["logging.log_interval=1", "logging.eval_interval=100000", "logging.eval_iters=0", "logging.plot=false",
         "logging.tensorboard=false", "logging.wandb_project=null"]
# Inputs the check brings itself (its seed checkpoint and data): the input rules needing them are not judged.
PROVIDES = ("data.sft_path", "checkpoint.pretrained")
# The runs in the order they start; those of one phase are independent of each other (reference and layout
# both start from the seed; reshard and reweights from the layout's and the reference's checkpoints).
PHASES = (("seed",), ("reference", "layout"), ("reshard", "reweights"))
MOCK = ["data=mock", "data.builtin_max_files=80", "data.builtin_vocab_size=600"]
OUTPUT = "check"  # what the check's own marker says its output folder is (files.OWN_MARKER)


def output_dir(cfg: RunConfig, given: Optional[Path]) -> Path:
    """The folder of the check's runs (``--dir``, default ``runs/check/<run.name>``), refused when it climbs
    upward ('..': ``run.name=..`` once named ``./runs``) or holds something the check did not write."""
    field = "--dir" if given is not None else "run.name"
    out = Path(given if given is not None else f"runs/check/{cfg.run.name}").expanduser()
    files.refuse_upward(out, field)
    out = out.resolve()
    files.check_removable(out, OUTPUT, field)
    return out


def check_flags(flags: dict) -> None:
    """The flags' ranges, before anything starts: a check that cannot compare two layouts proves nothing."""
    max_ranks, rtol = flags.get("max-ranks", 8), flags.get("rtol", 1e-5)
    if max_ranks < 2:
        raise RecipeError(f"{PROG}: --max-ranks {max_ranks} leaves one rank, the same as the one-rank reference, so "
                          "there would be nothing to compare", fix="use --max-ranks 2 or more (default 8)")
    if not (math.isfinite(rtol) and 0 < rtol < 1):
        raise RecipeError(f"{PROG}: --rtol {rtol} is not a relative tolerance: it must be a number above 0 and below 1",
                          fix="use e.g. --rtol 1e-5 (the default), or a little more when many steps add rounding up")
    if flags.get("steps", 6) < 3:
        raise RecipeError(f"{PROG}: --steps={flags['steps']} is too few", fix="use --steps 3 or more (the reshard resumes before the last two)")
    if flags.get("timeout", 900) < 1:
        raise RecipeError(f"{PROG}: --timeout {flags['timeout']} is not a time", fix="use --timeout in seconds, 1 or more (default 900)")


def context_parallel_unproven(cfg: RunConfig) -> Optional[str]:
    """Why this build cannot run ``cfg``'s CP>1 layout on CPU ranks (None when it can).

    The one place the check decides about context parallelism: the project's rule table and capability
    checks (the CPU lane's CP attention is ``cp_comm_type=all_gather``; the shrink step asks for it), then
    what that attention itself refuses (sliding windows, unequal MLA head sizes, ...).
    """
    if cfg.parallel.cp <= 1:
        return None
    from megatron_recipes.validation.validate import validate
    from megatron_recipes.models.capabilities import unmet_requirements
    from megatron_recipes.models.context_parallel import local_cp_limits

    reasons = [v.message for v in validate(cfg) if v.rule_id.startswith("cp.")]
    reasons += [r for r in unmet_requirements(cfg) if "parallel.cp" in r]
    limits = local_cp_limits(cfg)
    if limits:
        reasons.append(f"the CPU lane's CP attention (all_gather, no Transformer Engine) does not support {', '.join(limits)}")
    return "; ".join(reasons) or None


def _data(cfg: RunConfig) -> List[str]:
    """The recipe's own data when it runs here without files (built-in corpus or chat set); else mock tokens."""
    if cfg.data.kind == "builtin" and cfg.model.hidden_size <= 256:
        return []
    if cfg.data.kind == "sft" and cfg.data.tokenizer == "builtin" and cfg.model.hidden_size <= 256 and _builtin_sft(cfg):
        return []
    return MOCK


def _builtin_sft(cfg: RunConfig) -> bool:
    return not cfg.data.sft_path or str(cfg.data.sft_path).startswith("builtin")


def _compose(recipe: str, overrides: Sequence[str]) -> RunConfig:
    from megatron_recipes.config.compose import compose_recipe

    return compose_recipe(recipe, list(overrides))


def _validated(recipe: str, overrides: Sequence[str], what: str, cfg: Optional[RunConfig] = None) -> RunConfig:
    """``cfg`` (composed from ``overrides`` when not given) through the rule table and this build's support."""
    from megatron_recipes.validation.validate import validate_or_raise
    from megatron_recipes.models.capabilities import require_supported

    cfg = cfg if cfg is not None else _compose(recipe, overrides)
    try:
        validate_or_raise(cfg, f"{recipe} ({what})")
        require_supported(cfg)
    except RecipeError as exc:
        raise RecipeError(f"the check's {what} of {recipe} is not valid: {exc.render()}",
                          fix="the shrinking could not keep this layout valid; file the message above with the recipe") from None
    return cfg


def plan_runs(recipe: str, user: Sequence[str], max_ranks: int, steps: int, stop: int, out: Optional[Path] = None,
              full_depth: bool = False, cfg: Optional[RunConfig] = None):
    """(recipe cfg, Shrunk, per-run overrides, notes): everything decided before a process starts.

    ``out`` (default ``runs/check/<run name>``) holds the four runs: seed, reference, layout, reshard.
    ``cfg``: the recipe with ``user`` overrides, when already composed."""
    from megatron_recipes.validation.rules import select
    from megatron_recipes.validation.validate import validate_or_raise

    cfg = cfg if cfg is not None else _compose(recipe, user)
    out = output_dir(cfg, out)
    validate_or_raise(cfg, recipe, rules=select(provided=PROVIDES))  # the recipe as written, on its own cluster
    small = shrink(cfg, max_ranks, None if full_depth else LAYERS_PER_CHUNK, own_data=not _data(cfg))
    notes = list(small.notes)
    env = ["cluster=local_cpu", "cluster.nodes=1", *FP32, *_data(cfg), *OPTIMIZER, *QUIET,
           "checkpoint.save_interval=100000", "train.exit_interval=null"]
    if cfg.precision.params_dtype != "fp32" or cfg.precision.fp8 or cfg.precision.fp4:
        notes.append(f"precision {cfg.precision.name} -> fp32: the CPU lane trains in float32 (bf16 and FP8 are GPU-side)")
    p = cfg.parallel
    if p.overlap_moe_expert_parallel_comm or p.delay_wgrad_compute:
        # megatron-core's combined 1F1B schedule overlaps bf16/fp16 models only, and the one-rank reference has no
        # EP to overlap: both runs take the plain schedule, whose numbers the overlapped one reproduces
        env += ["parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false"]
        notes.append("EP communication overlap -> off: megatron-core overlaps bf16/fp16 models only and the check "
                     "trains in fp32 (deferred weight gradients also need Transformer Engine); the overlapped schedule "
                     "trains like the plain one on the CPU lane (tests/test_ep_overlap.py: bf16, EP2, PP2 x VPP2)")
    if _data(cfg):
        was = "" if cfg.data.kind == "mock" else f"data {cfg.data.kind} -> "
        notes.append(f"{was}mock tokens (megatron-core's MockGPTDataset): the layout, not the data, is checked")
    base = [*user, *env]
    layout = [*base, *small.layout]
    reference = [*base, *small.reference]
    for over in (layout, reference):
        over.append(f"train.train_iters={steps}")
    planned = {
        "seed": [*reference[:-1], *(["peft=none"] if cfg.peft.method != "none" else []), "train.train_iters=0", "checkpoint.pretrained=null", "checkpoint.load=none"],
        "reference": [*reference, "checkpoint.save=false", "checkpoint.load=none"],
        "layout": [*layout, f"train.exit_interval={stop}", "checkpoint.save=true", "checkpoint.load=none"],
        "reshard": [*reference, "checkpoint.save=false"],
    }
    seed = out / "seed" / "checkpoints"
    planned["reference"].append(f"checkpoint.pretrained={seed}")
    planned["layout"].append(f"checkpoint.pretrained={seed}")
    if cfg.parallel.fsdp:
        _weights_only_reshard(planned, reference, out, steps, stop)
        notes.append(f"reshard by weights: Megatron-FSDP checkpoints resume only at the layout that saved them, so the "
                     f"layout's step-{stop} weights are reloaded on one rank and compared with the one-rank run's own "
                     f"step-{stop} weights, both continuing {steps - stop} steps from a fresh optimizer")
    else:
        planned["reshard"] += [f"checkpoint.pretrained={seed}", f"checkpoint.load={out / 'layout' / 'checkpoints'}"]
    return cfg, small, planned, notes, out


def _weights_only_reshard(planned, reference: List[str], out: Path, steps: int, stop: int) -> None:
    """The reshard pair for Megatron-FSDP: the layout's weights and the reference's, loaded alike."""
    from megatron_recipes import checkpoint

    planned["reference"] += ["checkpoint.save=true", f"checkpoint.save_interval={stop}"]
    rest = [*reference[:-1], f"train.train_iters={steps - stop}", "checkpoint.save=false", "checkpoint.load=none"]
    planned["reshard"] = [*rest, f"checkpoint.pretrained={out / 'layout' / 'checkpoints'}"]
    planned["reweights"] = [*rest, f"checkpoint.pretrained={checkpoint.iter_dir(out / 'reference' / 'checkpoints', stop)}"]


def main(argv: List[str]) -> int:
    from megatron_recipes.training.cli import quiet_known_warnings

    quiet_known_warnings()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} <recipe> [key=value ...] [--max-ranks 8] [--steps 6] [--rtol 1e-5] [--dir DIR] [--full-depth]\n\n{__doc__}")
        return 0
    args = split_args(argv, PROG, FLAGS)
    check_flags(args.flags)
    recipe_cfg = _compose(args.recipe, args.overrides)
    given = args.flags.get("dir")
    output_dir(recipe_cfg, Path(given) if given else None)  # refused before the ranks' server starts
    # the ranks' server imports torch, megatron-core (and the tokenizer's library) while this process plans
    from megatron_recipes.runtime import ranks

    ranks.context(tokenizers=recipe_cfg.data.kind == "sft", compiles=derived.is_moe(recipe_cfg.model))
    try:
        return _check(args, recipe_cfg)
    finally:
        ranks.stop()  # every run has ended (or was stopped) by now


def _check(args, recipe_cfg: RunConfig) -> int:
    """The check itself, once the ranks' server is starting: plan, refuse or run, compare."""
    from megatron_recipes.check import runs

    max_ranks, steps = args.flags.get("max-ranks", 8), args.flags.get("steps", 6)
    timeout, rtol = args.flags.get("timeout", 900), args.flags.get("rtol", 1e-5)
    check_flags(args.flags)
    stop = steps - 2
    given = args.flags.get("dir")
    cfg, small, planned, notes, out = plan_runs(
        args.recipe, args.overrides, max_ranks, steps, stop, Path(given) if given else None, bool(args.flags.get("full-depth")),
        recipe_cfg,
    )
    if small.degrees.world < 2:
        raise RecipeError(f"{PROG}: the checked layout of {args.recipe} is {small.degrees.text(None)}, the same as the "
                          "one-rank reference: there is no parallel layout to prove",
                          fix="check a recipe (or overrides, e.g. parallel.tp=2) with more than one rank, and --max-ranks 2 or more")
    layout_cfg = _compose(args.recipe, planned["layout"])

    print(f"check {args.recipe}: recipe layout {small.original.text(cfg.parallel.vpp)}")
    print(f"  checked layout {small.degrees.text(layout_cfg.parallel.vpp)}, SP={'on' if layout_cfg.parallel.sp else 'off'}, "
          f"{layout_cfg.model.num_layers} layers, seq {layout_cfg.train.seq_length}, "
          f"{layout_cfg.train.global_batch_size} sequences per step; CPU lane (gloo), float32")
    for note in notes:
        print(f"  - {note}")
    why = context_parallel_unproven(layout_cfg)
    if why:
        print(f"verdict: CANNOT PROVE: the layout has CP={layout_cfg.parallel.cp}, which this build cannot run on "
              f"CPU ranks ({why}). Nothing was trained.", file=sys.stderr)
        return 2
    _validated(args.recipe, planned["layout"], "shrunk layout", layout_cfg)
    _validated(args.recipe, planned["reference"], "one-rank reference")
    files.fresh_own_dir(out, OUTPUT, "--dir" if given else "run.name")
    print(f"  runs in {out} (one log per run):", flush=True)
    results = {}
    world = {"layout": derived.world_size(layout_cfg)}
    for phase in PHASES:  # the runs of a phase are independent: they go side by side
        names = [name for name in phase if name in planned]
        if not names or ("reshard" in names and results["layout"].returncode != 0):
            break
        totals = {"seed": 0, "layout": stop, "reweights": steps - stop}
        if "reweights" in planned:
            totals["reshard"] = steps - stop
        jobs = [runs.Job(n, planned[n], out / n, totals.get(n, steps), world.get(n, 1)) for n in names]
        for result in runs.train_together(jobs, args.recipe, timeout):
            name = result.name
            results[name] = result
            print(f"  {name:<9} exit {result.returncode} in {result.seconds:.1f}s", flush=True)
            if result.returncode != 0:
                tail = "\n    ".join(result.output.strip().splitlines()[-15:])
                print(f"    last lines of {out / (name + '.log')}:\n    {tail}", file=sys.stderr)
                if name != "layout" or result.returncode == runs.RECIPE_ERROR:
                    code = runs.RECIPE_ERROR if result.returncode == runs.RECIPE_ERROR else 1
                    print(f"verdict: {'RECIPE ERROR' if code == 2 else 'FAILED'}: the {name} run exited with {result.returncode}", file=sys.stderr)
                    return code
    return _report(results, steps, stop, rtol, small, layout_cfg.parallel.vpp, _cp_scope(cfg, layout_cfg),
                   layout_cfg.model.mtp_num_layers)


def _cp_scope(cfg: RunConfig, layout_cfg: RunConfig) -> str:
    """What a PROVEN verdict says about CP: the exchange that ran here, and the recipe's when that differs."""
    cp = layout_cfg.parallel.cp
    if cp <= 1:
        return ""
    ran = layout_cfg.parallel.cp_comm_type
    text = f"CP={cp} proven with cp_comm_type={ran} on the CPU lane"
    if cfg.parallel.cp_comm_type != ran:
        text += f"; the recipe's {cfg.parallel.cp_comm_type} exchange needs Transformer Engine and is validated only"
    return text


def _pick(values: dict, steps: range) -> List[float]:
    return [values[s] for s in steps if s in values]


def _metrics(mtp_layers: Optional[int]) -> List[str]:
    """What both runs are judged by: the loss, each multi-token-prediction layer's loss, the gradient norm."""
    return ["loss", *(f"mtp_{k}_loss" for k in range(1, (mtp_layers or 0) + 1)), "grad_norm"]


def _reshard_series(results, steps: int, stop: int, metrics: List[str]) -> List[compare.Series]:
    """Steps stop+1..steps of the resharded run next to the one-rank run's (or its reloaded weights')."""
    resh = results["reshard"]
    if "reweights" in results:  # both runs count their steps from 1 again
        logged, ref = range(1, steps - stop + 1), results["reweights"]
    else:
        logged, ref = range(stop + 1, steps + 1), results["reference"]
    return [compare.Series(k, _pick(resh.series(k), logged), _pick(ref.series(k), logged), stop + 1) for k in metrics]


def _report(results, steps: int, stop: int, rtol: float, small: Shrunk, vpp: Optional[int], cp_scope: str = "",
            mtp_layers: Optional[int] = None) -> int:
    """Tables, then the verdict; the layout's logged steps are judged even when its run then failed."""
    ref, lay = results["reference"], results["layout"]
    trained = range(1, stop + 1)
    metrics = _metrics(mtp_layers)
    main_series = [compare.Series(k, _pick(lay.series(k), trained), _pick(ref.series(k), trained)) for k in metrics]
    print("\nlayout vs one rank, from the same seed checkpoint:")
    print(compare.table(main_series, "layout", "1-rank"))
    first = compare.judge(main_series, rtol)
    verdicts = [("the layout's training", first)]
    if "reshard" in results:
        resh_series = _reshard_series(results, steps, stop, metrics)
        if "reweights" in results:
            print(f"\nthe layout's step-{stop} weights vs the one-rank run's, each loaded on one rank (fresh optimizer, same batches):")
        else:
            print(f"\nresumed on one rank from the layout's step-{stop} checkpoint (resharded) vs the one-rank run:")
        print(compare.table(resh_series, "resumed", "1-rank"))
        verdicts.append(("the resharded resume", compare.judge(resh_series, rtol)))
    diverged = [(what, v) for what, v in verdicts if v.first_diverging_step is not None]
    if diverged:
        what, v = diverged[0]
        print(f"\nverdict: TRAINS WRONG: {what} differs from one rank; first diverging step: {v.first_diverging_step} "
              f"({v.reason})", file=sys.stderr)
        return 1
    if lay.returncode != 0:
        print(f"\nverdict: FAILED: the layout run exited with {lay.returncode} after {len(lay.series('loss'))} "
              "step(s), all equal to one rank up to there", file=sys.stderr)
        return 1
    incomplete = [(what, v) for what, v in verdicts if not v.equal]
    if incomplete:
        what, v = incomplete[0]
        print(f"\nverdict: FAILED: {what}: {v.reason}", file=sys.stderr)
        return 1
    if len(set(ref.series("loss").values())) < 2:
        print("\nverdict: FAILED: the loss did not change over the run, so equal losses prove nothing", file=sys.stderr)
        return 1
    scaled = f" (with {', '.join(n.upper() for n in small.reduced)} reduced: see above)" if small.reduced else ""
    print(f"\nverdict: PROVEN{scaled}: layout {small.degrees.text(vpp)} trains like one rank ({first.reason}, "
          "loss and gradient norm), and its checkpoint reloads resharded at another layout with the same next steps")
    if cp_scope:
        print(f"  {cp_scope}")
    return 0
