"""Shell completion (bash, and zsh through its bash compatibility): subcommands, recipes, config groups and
their options, the recipe's dotted keys, and each subcommand's flags.

``eval "$(megatron-recipes completion bash)"`` (or ``zsh``) installs a function that asks
``megatron-recipes complete <words...>`` for the candidates of the last word. Why the answers come from the
tool itself and not from a generated static list: recipes, groups and options are the files of the recipe
tree (``MEGATRON_RECIPES_DIR`` included) and the keys are ``config/schema.py``'s, so completion never goes
stale. Nothing here imports torch or megatron-core: a completion answers in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Dict, List, Sequence

from megatron_recipes.config.compose import list_group_options, list_recipes
from megatron_recipes.config.schema import FIELD_VALUES, RunConfig

RECIPE_COMMANDS = ("train", "plan", "check")  # the recipe is their first argument (slurm's: after its action)
PATH_COMMANDS = ("generate", "eval", "serve", "report")  # their first argument is a run dir or checkpoint
SWEEPS = ("train", "plan", "slurm")  # the commands that take -m (config/sweep.py)

SCRIPT = """# megatron-recipes completion ({shell}): eval "$(megatron-recipes completion {shell})"
{prelude}_megatron_recipes_complete() {{
    local IFS=$'\\n'
    COMPREPLY=($(COMP_WORDBREAKS="$COMP_WORDBREAKS" megatron-recipes complete --line "${{COMP_LINE:0:COMP_POINT}}" 2>/dev/null))
    [[ ${{#COMPREPLY[@]}} -eq 1 && ${{COMPREPLY[0]}} == *[=.] ]] && compopt -o nospace 2>/dev/null
    return 0
}}
complete -o default -F _megatron_recipes_complete megatron-recipes
"""


def script(shell: str) -> str:
    prelude = "autoload -U +X bashcompinit && bashcompinit\n" if shell == "zsh" else ""
    return SCRIPT.format(shell=shell, prelude=prelude)


def _keys(cls=RunConfig, prefix: str = "") -> Dict[str, type]:
    """Every dotted key of the schema and its type."""
    hints = typing.get_type_hints(cls)
    out: Dict[str, type] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # Optional[RopeScalingConfig]
        if dataclasses.is_dataclass(inner):
            out.update(_keys(inner, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = tp
    return out


def _values(tp) -> List[str]:
    args = typing.get_args(tp)
    base = next((a for a in args if a is not type(None)), tp) if args else tp
    if base is bool:
        return ["true", "false"]
    if isinstance(base, type) and issubclass(base, Enum):
        return [m.name for m in base]
    return []


def _flags(command: str) -> List[str]:
    """The command's own flags (its module's ``FLAGS``), and -m where it sweeps."""
    import importlib

    from megatron_recipes.cli import SUBCOMMANDS

    if command not in SUBCOMMANDS:
        return []
    flags = getattr(importlib.import_module(SUBCOMMANDS[command][0].split(":")[0]), "FLAGS", {})
    if command == "slurm":  # per action
        flags = {name: spec for action in flags.values() for name, spec in action.items()}
    names = [f"--{name}" for name in flags if name != "help"]
    return names + (["-m", "--multirun"] if command in SWEEPS else [])


def _groups() -> List[str]:
    from megatron_recipes.config.listing import groups

    return groups()


def _override(word: str) -> List[str]:
    """Candidates for a ``key=value`` word being typed."""
    groups = _groups()
    if "=" in word:
        key, _, typed = word.partition("=")
        options = list_group_options(key) if key in groups else list(FIELD_VALUES.get(key, ())) or _values(_keys().get(key, str))
        return [f"{key}={o}" for o in options if o.startswith(typed)]
    names = [f"{g}=" for g in groups] + [f"{k}=" for k in _keys()]
    found = [n for n in names if n.startswith(word)]
    if "." not in word:  # the top of the tree first: "train." rather than thirty train.* keys at once
        sections = sorted({n.split(".")[0] + "." for n in found if "." in n})
        found = [n for n in found if "." not in n] + sections
    return found


def candidates(words: Sequence[str]) -> List[str]:
    """What the last of ``words`` (the command line after ``megatron-recipes``) may become."""
    from megatron_recipes.cli import SUBCOMMANDS

    words = list(words) or [""]
    current, before = words[-1], words[:-1]
    if not before:
        return [s for s in SUBCOMMANDS if s.startswith(current)]
    command = before[0]
    positional = [w for w in before[1:] if not w.startswith("-") and "=" not in w]
    if current.startswith("-"):
        return [f for f in _flags(command) if f.startswith(current)]
    if command == "slurm" and not positional:
        return [a for a in ("render", "submit") if a.startswith(current)]
    if command == "list" and not positional:
        return [w for w in ("recipes", "groups", *_groups()) if w.startswith(current)]
    recipe_slot = (command in RECIPE_COMMANDS and not positional) or (command == "slurm" and len(positional) == 1)
    if recipe_slot and "=" not in current:
        return [r for r in list_recipes() if r.startswith(current)]  # a recipe file: the shell's own completion
    if command in PATH_COMMANDS and not positional:
        return []  # a run dir: the shell completes paths
    if command in RECIPE_COMMANDS or command == "slurm":
        return _override(current)
    return []


def main(argv: List[str]) -> int:
    """``megatron-recipes completion bash|zsh``: the script to source."""
    from megatron_recipes.config.errors import RecipeError

    if not argv or argv[0] in ("-h", "--help"):
        print('usage: megatron-recipes completion bash|zsh   (then: eval "$(megatron-recipes completion bash)")')
        return 0
    if argv[0] not in ("bash", "zsh"):
        raise RecipeError(f"completion for '{argv[0]}' is not written", fix="use bash or zsh")
    print(script(argv[0]), end="")
    return 0


def for_line(line: str, wordbreaks: str) -> List[str]:
    """Candidates for the command line up to the cursor, as the shell's current word: bash splits words at
    ``COMP_WORDBREAKS`` characters (``=`` and ``:`` among them), so after ``parallel=`` it completes ``tp2``."""
    words = line.split()
    if not line or line[-1].isspace():
        words.append("")
    found = candidates(words[1:])
    last = words[-1] if len(words) > 1 else ""
    cut = max((last.rfind(ch) for ch in set(wordbreaks) & {"=", ":"}), default=-1)
    return [c[cut + 1:] for c in found if c.startswith(last[: cut + 1])] if cut >= 0 else found


def complete_main(argv: List[str]) -> int:
    """``megatron-recipes complete --line "<line>"`` (the script's question) or ``complete <words...>``."""
    import os

    if argv[:1] == ["--line"]:
        print("\n".join(for_line(argv[1] if len(argv) > 1 else "", os.environ.get("COMP_WORDBREAKS", ""))))
    else:
        print("\n".join(candidates(argv)))
    return 0
