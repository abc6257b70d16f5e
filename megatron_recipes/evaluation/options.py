"""``eval``'s ``key=value`` options (typed by ``cli_args.options``, like ``generate``'s; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_recipes.cli_args import options
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.generate.options import Dtype, Layout

WHAT = ("loss", "answers", "tasks")  # what eval measures; answers only for fine-tuning (data.kind=sft) runs,
# tasks: lm-evaluation-harness tasks (tasks=)


@dataclass
class EvalOptions:
    what: Optional[str] = None  # comma list of WHAT; unset: loss, and answers for fine-tuning runs
    eval_iters: Optional[int] = field(default=None, metadata={"min": 1})  # unset: the run's logging.eval_iters
    answers: int = field(default=0, metadata={"min": 0})  # validation answers to generate; 0: all of them
    max_new_tokens: int = field(default=32, metadata={"min": 1})  # per answer
    batch_size: int = field(default=16, metadata={"min": 1})  # answers generated together
    dtype: Optional[Dtype] = None  # unset: fp32 on the CPU lane, the checkpoint's precision on GPUs
    parallel: Layout = field(default_factory=Layout)
    tasks: Optional[str] = None  # lm-eval tasks: a comma list of task names or task YAML files
    include_path: Optional[str] = None  # a folder of lm-eval task YAMLs (lm-eval's --include_path)
    num_fewshot: Optional[int] = field(default=None, metadata={"min": 0})  # unset: each task's own
    limit: Optional[float] = field(default=None, metadata={"min": 0})  # documents per task (below 1: a share)
    apply_chat_template: bool = False  # render lm-eval's prompts with the run's chat template (lm-eval's flag)

    def measures(self, fine_tuned: bool) -> tuple:
        if self.what is None:
            if self.tasks:  # naming tasks asks for them alone
                return ("tasks",)
            return ("loss", "answers") if fine_tuned else ("loss",)
        return tuple(part.strip() for part in self.what.split(","))

    def task_list(self) -> list:
        return [t.strip() for t in (self.tasks or "").split(",") if t.strip()]


def parse(overrides, prog: str) -> EvalOptions:
    opts = options(overrides, prog, EvalOptions)
    if opts.what is not None:
        unknown = [p for p in opts.measures(True) if p not in WHAT]
        if unknown or not opts.measures(True):
            raise RecipeError(f"{prog}: what={opts.what} names {unknown or 'nothing'}", fix=f"use a comma list of {', '.join(WHAT)}")
    if "tasks" in opts.measures(True) and not opts.task_list():
        raise RecipeError(f"{prog}: what=tasks needs tasks=<lm-eval task names or YAML files>",
                          fix="pass e.g. tasks=my_task include_path=<folder of task YAMLs>")
    return opts
