"""`megatron-recipes` command line: a thin dispatcher; each subcommand's module parses its own arguments.

Errors the user can fix (``RecipeError``) are printed as one message without a traceback, exit code 2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys

from megatron_recipes.cli_args import HelpRequested, subcommand
from megatron_recipes.config.errors import RecipeError

# subcommand -> "module:function"; each function takes argv (after the subcommand) and returns an exit code
SUBCOMMANDS = {
    "train": ("megatron_recipes.training.cli:main", "train a recipe (torchrun, or self-spawned CPU ranks)"),
    "plan": ("megatron_recipes.plan.cli:main", "validate a recipe, print its layout, groups and memory"),
    "check": ("megatron_recipes.check.cli:main", "prove a recipe's parallel layout on CPU ranks against one rank"),
    "convert": ("megatron_recipes.convert.cli:main", "HF <-> Megatron checkpoints: import, export, verify"),
    "data": ("megatron_recipes.data.cli:main", "preprocess corpora, build index caches"),
    "slurm": ("megatron_recipes.slurm.cli:main", "render or submit sbatch scripts"),
    "report": ("megatron_recipes.report.cli:main", "write a run directory's report.html (also while it runs)"),
    "generate": ("megatron_recipes.generate.cli:main", "text from a run's checkpoint (megatron-core's inference engine)"),
    "eval": ("megatron_recipes.evaluation.cli:main", "score a checkpoint: held-out loss, generated answers"),
    "serve": ("megatron_recipes.serve.cli:main", "an OpenAI-compatible HTTP endpoint on a checkpoint"),
    "list": ("megatron_recipes.config.listing:main", "the recipes, the config groups and their options"),
    "completion": ("megatron_recipes.completion:main", 'shell completion: eval "$(megatron-recipes completion bash)"'),
    "complete": ("megatron_recipes.completion:complete_main", "(the completion script's question: candidates)"),
}

# subcommands that import megatron-core: the entry point applies runtime/patches/'s "process" scope first
USE_MEGATRON_CORE = ("train", "plan", "check", "convert", "report")  # generate and eval apply it after --help

USAGE = "usage: megatron-recipes <subcommand> <recipe> [key=value ...] [--flags]\n\nsubcommands:\n" + "\n".join(
    f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()
)


class _ProcessPatches(importlib.abc.MetaPathFinder):
    """Applies runtime/patches/'s ``process`` scope the moment megatron-core is first imported, not before:
    help, a flag typo or a bad override then answers without the seconds torch and megatron-core take."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron.core" and self in sys.meta_path:
            sys.meta_path.remove(self)
            from megatron_recipes.runtime import patches

            patches.apply("process")  # refuses an unsupported megatron-core (a RecipeError from the import)
        return None  # the import itself goes on as usual


def _patch_before_megatron_core() -> None:
    from megatron_recipes.runtime import mcore_compat  # no torch: the installed release's metadata only

    mcore_compat.require_supported()  # now, in this process: some commands use megatron-core in children only
    if "megatron.core" in sys.modules:  # already imported (an embedding program): apply now
        from megatron_recipes.runtime import patches

        patches.apply("process")
    elif not any(isinstance(f, _ProcessPatches) for f in sys.meta_path):
        sys.meta_path.insert(0, _ProcessPatches())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        picked = subcommand(argv, list(SUBCOMMANDS), USAGE, "subcommand")
    except RecipeError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    if picked is None:
        return 0
    name, rest = picked
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    wants_help = any(a in ("-h", "--help") for a in rest)
    from megatron_recipes.runtime import known_warnings

    known_warnings.quiet()
    tally = known_warnings.start_tally() if name not in ("complete", "completion", "list") else None
    try:
        if name in USE_MEGATRON_CORE and not wants_help:  # others (data preprocess) must not even import torch
            _patch_before_megatron_core()
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(rest) or 0)
    except HelpRequested as help_:
        print(help_.text)
        return 0
    except RecipeError as exc:
        if "RANK" in os.environ:  # one rank of a job (eval, generate, serve): the launcher says it once
            from megatron_recipes.runtime.rank_errors import report

            report(exc.render())
        else:
            print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    finally:
        known_warnings.close_tally(tally)


if __name__ == "__main__":
    sys.exit(main())
