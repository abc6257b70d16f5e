"""``megatron-recipes report <run.dir> [--out report.html]``: (re)write a run's self-contained HTML report.

Safe while the run is going: it only reads the run directory and replaces the page atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_recipes.cli_args import split_args
from megatron_recipes.config.errors import RecipeError

PROG = "megatron-recipes report"


def main(argv: Sequence[str]) -> int:
    args = split_args(argv, PROG, flags={"out": True}, positional=("run_dir",))
    if args.overrides or len(args.positional) != 1:
        raise RecipeError(f"{PROG}: takes one run directory", fix=f"usage: {PROG} <run.dir> [--out report.html]")
    from megatron_recipes.report import build_report

    path = build_report(Path(args.positional[0]), Path(str(args.flags["out"])) if "out" in args.flags else None)
    print(f"report: {path}")
    return 0
