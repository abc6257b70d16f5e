"""Argument splitting shared by every subcommand: ``<recipe> key=value ... --flag [value]``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Union

from megatron_recipes.config.errors import RecipeError

FlagValue = Union[str, bool]


@dataclass
class Args:
    positional: List[str] = field(default_factory=list)
    overrides: List[str] = field(default_factory=list)  # key=value / group=option, in order
    flags: Dict[str, FlagValue] = field(default_factory=dict)

    @property
    def recipe(self) -> str:
        return self.positional[0]


def split_args(
    argv: Sequence[str],
    prog: str,
    flags: Mapping[str, bool] = {},
    positional: Sequence[str] = ("recipe",),
    optional_positional: int = 0,
) -> Args:
    """Split argv. ``flags`` maps flag name (without --) to whether it takes a value.

    Unknown flags and missing positionals raise RecipeError naming the accepted ones.
    """
    out = Args()
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            name, eq, value = item[2:].partition("=")
            if name not in flags:
                known = ", ".join(f"--{f}" for f in flags) or "none"
                raise RecipeError(f"{prog}: unknown flag '--{name}'", fix=f"accepted flags: {known}")
            if flags[name]:
                if not eq:
                    if i + 1 >= len(items):
                        raise RecipeError(f"{prog}: flag '--{name}' needs a value", fix=f"--{name} <value>")
                    i += 1
                    value = items[i]
                out.flags[name] = value
            else:
                if eq:
                    raise RecipeError(f"{prog}: flag '--{name}' takes no value", fix=f"write just --{name}")
                out.flags[name] = True
        elif "=" in item:
            out.overrides.append(item)
        else:
            out.positional.append(item)
        i += 1
    need = len(positional) - optional_positional
    if len(out.positional) < need:
        names = " ".join(f"<{p}>" for p in positional)
        raise RecipeError(f"{prog}: missing {positional[len(out.positional)]}", fix=f"usage: {prog} {names} [key=value ...]")
    if len(out.positional) > len(positional):
        extra = out.positional[len(positional)]
        raise RecipeError(
            f"{prog}: unexpected argument '{extra}'",
            fix="overrides are key=value (e.g. parallel.tp=2); flags start with --",
        )
    return out


def kv_options(overrides: Sequence[str], prog: str, allowed: Mapping[str, Optional[str]]) -> Dict[str, str]:
    """Parse ``key=value`` options of a non-recipe command. ``allowed`` maps key -> default (None = required)."""
    values: Dict[str, str] = {}
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key not in allowed:
            raise RecipeError(f"{prog}: unknown option '{key}'", fix=f"accepted: {', '.join(f'{k}=' for k in allowed)}")
        values[key] = value
    for key, default in allowed.items():
        if key not in values:
            if default is None:
                raise RecipeError(f"{prog}: missing required option '{key}='", fix=f"add {key}=<value>")
            values[key] = default
    return values
