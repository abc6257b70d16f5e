"""``megatron-recipes eval <run dir | checkpoint> [key=value ...] [--json]``.

What a checkpoint scores, through the same megatron-core model the run trained (any saved layout):

loss     held-out loss and perplexity on the run's validation split, the batches the trainer evaluated
         (``logging.eval_iters`` of them unless eval_iters= says otherwise): equal to the log's val_loss
answers  a fine-tuning run's validation answers generated greedily (megatron-core's inference engine) and
         scored exact-match against the references; default for runs with data.kind=sft
tasks    lm-evaluation-harness tasks (tasks=<names or task YAML files>, needs pip install "megatron-recipes[eval]"):
         the same scores lm-eval gives the exported model; the default when tasks= is given

options  what=loss,answers,tasks  eval_iters=<batches>  answers=<count, 0: all>  max_new_tokens=32  batch_size=16
         dtype=bf16|fp32  parallel.tp= parallel.pp= parallel.ep= parallel.etp=  (default: the checkpoint's layout)
         tasks=<a,b>  include_path=<folder of task YAMLs>  num_fewshot=  limit=<documents per task>
         apply_chat_template=true|false (lm-eval's flag; default false)
flags    --json (one JSON record on stdout)  --trust-checkpoint (see SECURITY.md)

Results are also kept as JSON beside the run: <run dir>/eval/step_NNNNNNN.json (every answer included).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron_recipes import checkpoint
from megatron_recipes.cli_args import split_args
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.evaluation import options as opts_mod

PROG = "megatron-recipes eval"
FLAGS = {"json": False, "trust-checkpoint": False}


@dataclass
class Plan:
    """What every rank runs (each computes it from the same command line and files)."""

    ckpt: Path
    step: int
    layout: Any
    dtype: str
    measures: tuple
    opts: opts_mod.EvalOptions
    as_json: bool
    trained: Any  # the run's train settings (its batches)
    picture: bool  # the run's logging.plot: its report carries the layout picture
    moe: bool  # an MoE model (its ranks call torch.compile'd functions)
    maker: Any = None
    questions: Optional[list] = None
    prompts: Optional[list] = None
    tokenizer: Any = None  # the run's (answers, tasks)


def prepare(argv: List[str]) -> Plan:
    from megatron_recipes.config.derived import is_moe
    from megatron_recipes.generate.cli import default_dtype, layout_for

    args = split_args(argv, PROG, flags=FLAGS, positional=("checkpoint",))
    opts = opts_mod.parse(args.overrides, PROG)
    if args.flags.get("trust-checkpoint"):
        os.environ[checkpoint.TRUST_ENV] = "1"
    resolved, cfg, meta = checkpoint.read_run(checkpoint.resolve(Path(args.positional[0])))
    fine_tuned = cfg.data.kind == "sft"
    measures = opts.measures(fine_tuned)
    if "answers" in measures and not fine_tuned:
        raise RecipeError(
            f"{PROG}: what=answers scores a fine-tuning run's validation answers; this run has data.kind={cfg.data.kind}",
            fix="use what=loss",
        )
    layout = layout_for(meta.get("layout") or {}, opts.parallel.given())
    dtype = opts.dtype.value if opts.dtype is not None else default_dtype(cfg)
    plan = Plan(resolved, int(meta.get("step") or 0), layout, dtype, measures, opts, bool(args.flags.get("json")), cfg.train,
                cfg.logging.plot, is_moe(cfg.model))
    if "tasks" in measures:
        from megatron_recipes.evaluation.tasks import require_lm_eval, resolve, task_manager

        require_lm_eval()
        task_manager(*resolve(opts.task_list(), opts.include_path))  # an unknown task is refused before any rank starts
    if "answers" in measures or "tasks" in measures:
        from megatron_recipes.data.prompts import PromptMaker, run_tokenizer, wants_chat
        from megatron_recipes.data.tokenizer import check_fits_model

        plan.tokenizer = run_tokenizer(cfg, resolved, meta)
        check_fits_model(plan.tokenizer, cfg)
        if wants_chat(cfg, None):
            plan.maker = PromptMaker(plan.tokenizer, cfg, chat=True)
    if "answers" in measures:
        from megatron_recipes.evaluation.answers import validation_questions

        plan.questions = validation_questions(cfg, opts.answers)
        plan.prompts = [plan.maker.encode(q.prompt, q.history) for q in plan.questions]
    return plan


def evaluate_here(plan: Plan) -> Optional[Dict[str, Any]]:
    """This rank's share; rank 0 gets the results."""
    import torch

    from megatron_recipes.generate.engine import Job, Sampling, generate_ids, model_for
    from megatron_recipes.runtime.distributed import shutdown

    results: Dict[str, Any] = {}
    try:
        loaded = model_for(str(plan.ckpt), plan.layout, plan.dtype)
        if "loss" in plan.measures:
            from megatron_recipes.evaluation.heldout import heldout_loss

            results["loss"] = heldout_loss(loaded[0], loaded[1], plan.opts.eval_iters, plan.trained)
        if "answers" in plan.measures:
            from megatron_recipes.evaluation.answers import score

            greedy = Sampling(plan.opts.max_new_tokens, 0.0, 0, 0.0, 1234)
            job = Job(str(plan.ckpt), plan.layout, plan.dtype, [p.ids for p in plan.prompts], greedy,
                      plan.maker.termination_id, plan.opts.batch_size)
            generated = generate_ids(job, plan.maker.ended, loaded=loaded)
            if generated is not None:
                answers = [plan.maker.answer(p, ids, plan.opts.max_new_tokens) for p, ids in zip(plan.prompts, generated)]
                results["answers"] = score(plan.questions, answers)
        if "tasks" in plan.measures:
            from megatron_recipes.evaluation.tasks import run_tasks

            tasks = run_tasks(plan, loaded, plan.tokenizer)
            if tasks is not None:
                results["tasks"] = tasks
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    finally:
        shutdown()
    return results if rank == 0 else None


def _layout_text(layout) -> str:
    from megatron_recipes.convert import layout as layouts

    return layouts.layout_string(layout)


def summary(plan: Plan, results: Dict[str, Any]) -> str:
    lines = [f"eval of {plan.ckpt} (step {plan.step}) at {_layout_text(plan.layout)}, {plan.dtype}"]
    loss = results.get("loss")
    if loss:
        lines.append(f"  held-out loss   {loss['val_loss']:.4f} nats/token (perplexity {loss['perplexity']:.3f}) over "
                     f"{loss['eval_iters']} batches ({loss['sequences']:,} sequences)")
    answers = results.get("answers")
    if answers:
        lines.append(f"  answers         {answers['exact_match']:.1%} exact match ({answers['right']} of {answers['answers']} "
                     "validation answers, generated greedily)")
    if results.get("tasks"):
        from megatron_recipes.evaluation.tasks import summary_lines

        lines += ["  lm-eval tasks"] + summary_lines(results["tasks"])
    return "\n".join(lines)


def record(plan: Plan, results: Dict[str, Any]) -> Dict[str, Any]:
    where = {"layout": _layout_text(plan.layout), "dtype": plan.dtype}
    return {"checkpoint": str(plan.ckpt), "step": plan.step, **where,
            **{measure: {**value, **where} for measure, value in results.items()}}


def keep(plan: Plan, full: Dict[str, Any]) -> Optional[Path]:
    """``<run dir>/eval/step_NNNNNNN.json`` when the checkpoint lies in a run dir; None when it cannot be written."""
    from megatron_recipes import files
    from megatron_recipes.run_files import EVAL_DIR

    root = plan.ckpt.parent
    if root.name != checkpoint.CHECKPOINTS:
        return None
    path = root.parent / EVAL_DIR / f"step_{plan.step:07d}.json"
    try:  # measures of this step kept before (another what= or tasks=) stay beside the new ones
        earlier = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        earlier = {}
    if earlier.get("step") == full["step"]:
        full = {**earlier, **full}
    try:
        kept = files.write_text(path, json.dumps(full, indent=2, ensure_ascii=False) + "\n")
    except OSError as exc:
        print(f"note: could not keep the results in {path}: {exc}", file=sys.stderr)
        return None
    from megatron_recipes.report import REPORT_NAME, write_report_after_run

    if (root.parent / REPORT_NAME).is_file():  # the run's report shows its evaluations: rewrite it
        with contextlib.redirect_stdout(sys.stderr):
            write_report_after_run(root.parent, picture=plan.picture)
    return kept


def show(plan: Plan, results: Dict[str, Any]) -> None:
    full = record(plan, results)
    kept = keep(plan, full)
    if plan.as_json:
        brief = dict(full)
        if "answers" in full:
            brief["answers"] = {k: v for k, v in full["answers"].items() if k != "records"}
        if "tasks" in full:
            brief["tasks"] = {k: v for k, v in full["tasks"].items() if k != "samples"}
        print(json.dumps(brief, ensure_ascii=False), flush=True)
        return
    print(summary(plan, results) + (f"\n  kept in {kept}" if kept else ""), flush=True)


def main(argv: List[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help") or "--help" in argv:
        print(__doc__.strip())
        return 0
    os.environ.setdefault("TQDM_DISABLE", "1")
    from megatron_recipes.runtime import patches

    patches.apply("process")
    from megatron_recipes.convert import layout as layouts
    from megatron_recipes.runtime.local_launch import spawn_local
    from megatron_recipes.training.cli import quiet_known_warnings, under_launcher

    quiet_known_warnings()
    plan = prepare(argv)
    world = layouts.min_world_size(plan.layout)
    if not under_launcher() and world > 1:
        sys.stdout.flush()
        return spawn_local(argv, world, target=("--module", "megatron_recipes.evaluation"), tokenizers=True,
                           compiles=plan.moe)
    results = evaluate_here(plan)
    if results is not None:
        show(plan, results)
    return 0
