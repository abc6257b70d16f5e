"""`megatron-recipes list [recipes|groups|GROUP]`: what the recipe tree offers, without a typo to find out.

Reads the recipe folder only (no Hydra composition, no torch): it answers at once.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import List, Sequence

from megatron_recipes.config.compose import list_group_options, list_recipes, recipes_dir
from megatron_recipes.config.errors import RecipeError

USAGE = """usage: megatron-recipes list [recipes|groups|GROUP]

  recipes   the recipes (the first argument of train, plan, check, slurm), with their first comment line
  groups    every config group and its options (override one with GROUP=OPTION, e.g. parallel=tp2)
  GROUP     one group's options, e.g. `megatron-recipes list parallel`

The recipe tree is {root} (set MEGATRON_RECIPES_DIR to use another)."""


def groups() -> List[str]:
    return sorted(p.name for p in recipes_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def _summary(path: Path) -> str:
    """A YAML file's first comment line (its description), else its first setting."""
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError:
        return ""
    comments = [ln.lstrip("#").strip() for ln in lines if ln.startswith("#")]
    if comments:
        return comments[0]
    settings = [ln for ln in lines if not ln.startswith(("#", "defaults", "-"))]
    return ", ".join(settings[:3])


def _table(rows: Sequence[tuple]) -> str:
    width = max((len(name) for name, _ in rows), default=0)
    return "\n".join(f"  {name:<{width}}  {text}".rstrip() for name, text in rows)


def render(what: str) -> str:
    root = recipes_dir()
    if what == "recipes":
        return "recipes:\n" + _table([(name, _summary(root / f"{name}.yaml")) for name in list_recipes()])
    if what == "groups":
        return "groups (GROUP=OPTION on the command line):\n" + _table(
            [(group, ", ".join(list_group_options(group))) for group in groups()])
    if what in groups():
        return f"{what} options ({what}=OPTION):\n" + _table(
            [(name, _summary(root / what / f"{name}.yaml")) for name in list_group_options(what)])
    close = difflib.get_close_matches(what, ["recipes", "groups", *groups()], n=1)
    raise RecipeError(f"megatron-recipes list: nothing called '{what}'",
                      fix=(f"did you mean {close[0]}? " if close else "") + f"use recipes, groups or one of {', '.join(groups())}")


def main(argv: List[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE.format(root=recipes_dir()))
        return 0
    if len(argv) > 1:
        raise RecipeError(f"megatron-recipes list: one argument at most, got {len(argv)}", fix="e.g. megatron-recipes list parallel")
    print(render(argv[0] if argv else "recipes"))
    return 0
