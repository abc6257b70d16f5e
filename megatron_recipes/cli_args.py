"""Typed command-line arguments shared by every subcommand: ``<positional> key=value ... --flag [value]``.

Flags and positionals go through argparse (each flag declares its type); ``key=value`` options of a
non-recipe command are a dataclass, typed by OmegaConf, so no subcommand converts strings by hand.
Recipe overrides stay strings: Hydra types them against the recipe schema. Every bad value is a
``RecipeError`` naming the argument and a fix (the CLI prints it and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_recipes.config.errors import RecipeError

# A flag's declaration: False = a switch; True = a text value; a callable = a typed value (int, float, ...).
FlagSpec = Union[bool, Callable[[str], Any]]
FlagValue = Any
T = TypeVar("T")


@dataclass
class Args:
    positional: List[str] = field(default_factory=list)
    overrides: List[str] = field(default_factory=list)  # key=value / group=option, in order
    flags: Dict[str, FlagValue] = field(default_factory=dict)  # only the flags given, typed

    @property
    def recipe(self) -> str:
        return self.positional[0]


def subcommand(argv: Sequence[str], names: Sequence[str], usage: str, what: str) -> Optional[Tuple[str, List[str]]]:
    """``(name, rest)`` of a command line that starts with one of ``names``; None after printing ``usage``
    for help (or no argument). An unknown name is a ``RecipeError`` listing the known ones (exit 2)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        return None
    if argv[0] not in names:
        raise RecipeError(f"unknown {what} '{argv[0]}'", fix=f"use one of {', '.join(names)}")
    return argv[0], list(argv[1:])


class HelpRequested(Exception):
    """``--help`` among a subcommand's arguments: the CLI prints ``text`` and exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def help_text(prog: str, flags: Mapping[str, FlagSpec], positional: Sequence[str]) -> str:
    """A subcommand's usage, its flags and, for recipe commands, where the recipes and groups are listed."""
    names = " ".join(f"<{p}>" for p in positional)
    lines = [f"usage: {prog} {names} [key=value ...]" + "".join(f" [--{f}{'' if s is False else ' <value>'}]"
                                                             for f, s in flags.items())]
    if "recipe" in positional:
        from megatron_recipes.config.compose import list_recipes
        from megatron_recipes.config.listing import groups

        lines += ["", "recipes: " + ", ".join(list_recipes()),
                  "groups (GROUP=OPTION): " + ", ".join(groups()) + " (`megatron-recipes list GROUP` shows the options)",
                  "overrides: key=value, Hydra style (`megatron-recipes plan <recipe> --show-config` prints every key)",
                  "sweeps: -m key=a,b ... (Hydra's multirun: one run per combination, each in its own run.dir subfolder)"]
    return "\n".join(lines)


def hydra_cfg(value: Optional[str], cfg) -> bool:
    """Hydra's ``--cfg job`` (also ``all``): print the resolved recipe and stop; True when printed."""
    if value is None:
        return False
    if value not in ("job", "all"):
        raise RecipeError(f"--cfg {value}: this tool prints the recipe (--cfg job); it has no Hydra settings of its own",
                          fix="use --cfg job")
    from megatron_recipes.config.compose import to_yaml

    print(to_yaml(cfg), end="")
    return True


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)  # ValueError: argparse names the flag and the value
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # argparse's message: "invalid positive integer value: '0'"


class _Parser(argparse.ArgumentParser):
    """argparse that raises a RecipeError (flag, value, fix) instead of printing usage and exiting."""

    def __init__(self, prog: str, fix: str):
        super().__init__(prog=prog, add_help=False, allow_abbrev=False)
        self.fix = fix

    def error(self, message: str):  # type: ignore[override]
        raise RecipeError(f"{self.prog}: {message}", fix=self.fix)


def _flag_fix(flags: Mapping[str, FlagSpec]) -> str:
    known = ", ".join(f"--{f}" + ("" if spec is False else " <value>") for f, spec in flags.items()) or "none"
    return f"accepted flags: {known}; overrides are key=value (e.g. parallel.tp=2)"


def split_args(
    argv: Sequence[str],
    prog: str,
    flags: Mapping[str, FlagSpec] = {},
    positional: Sequence[str] = ("recipe",),
    optional_positional: int = 0,
) -> Args:
    """Split argv: flags (``flags`` maps name without -- to its declaration) and positionals through
    argparse, ``key=value`` items kept in order. Unknown flags, bad flag values and missing positionals
    raise RecipeError naming the accepted ones."""
    if any(a in ("-h", "--help") for a in argv):
        raise HelpRequested(help_text(prog, flags, positional))
    parser = _Parser(prog, _flag_fix(flags))
    for name, spec in flags.items():
        if spec is False:
            parser.add_argument(f"--{name}", action="store_true", default=None)
        else:
            parser.add_argument(f"--{name}", type=str if spec is True else spec, default=None)
    parser.add_argument("positional", nargs="*")
    takes_value = {f"--{name}" for name, spec in flags.items() if spec is not False}
    rest: List[str] = []
    overrides: List[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item in takes_value and i + 1 < len(items):  # "--out path": the value may hold '='
            rest += [item, items[i + 1]]
            i += 2
            continue
        (overrides if "=" in item and not item.startswith("-") else rest).append(item)
        i += 1
    for item in rest:  # argparse would read an unknown --x=1 as a positional after "--"
        if item.startswith("--") and item.split("=", 1)[0] not in {f"--{n}" for n in flags}:
            parser.error(f"unknown flag '{item.split('=', 1)[0]}'")
    ns = parser.parse_intermixed_args(rest)
    found = {name: getattr(ns, name.replace("-", "_")) for name in flags}
    out = Args(positional=list(ns.positional), overrides=overrides, flags={k: v for k, v in found.items() if v is not None})
    need = len(positional) - optional_positional
    names = " ".join(f"<{p}>" for p in positional)
    if len(out.positional) < need:
        raise RecipeError(f"{prog}: missing {positional[len(out.positional)]}", fix=f"usage: {prog} {names} [key=value ...]")
    if len(out.positional) > len(positional):
        extra = out.positional[len(positional)]
        raise RecipeError(f"{prog}: unexpected argument '{extra}'",
                          fix="overrides are key=value (e.g. parallel.tp=2); flags start with --")
    return out


def _kind(tp: Any) -> Tuple[str, str, bool]:
    """(what a value of this field type is, an example, whether it may be null)."""
    args = typing.get_args(tp)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), tp) if args else tp
    if isinstance(base, type) and issubclass(base, Enum):
        names = [m.name for m in base]
        return f"one of {', '.join(names)}", names[0], optional
    kinds = {int: ("an integer", "2"), float: ("a number", "0.5"), bool: ("a boolean", "true"), str: ("text", "...")}
    kind, example = kinds.get(base, (str(base), "..."))
    return kind, example, optional


def _fields(cls: type, prefix: str = "") -> Dict[str, Tuple[dataclasses.Field, Any]]:
    """Dotted key -> (field, its resolved type), through nested dataclasses (``parallel.tp``)."""
    hints = typing.get_type_hints(cls)
    out: Dict[str, Tuple[dataclasses.Field, Any]] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_fields(tp, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (f, tp)
    return out


def options(overrides: Sequence[str], prog: str, cls: Type[T]) -> T:
    """``key=value`` options of a non-recipe command -> a ``cls`` instance, typed by OmegaConf.

    ``cls`` is a dataclass: fields without a default (``MISSING``) are required, ``Optional`` fields take
    ``null``, and ``field(metadata={"min": n})`` bounds a number.
    """
    known = _fields(cls)
    conf = OmegaConf.structured(cls)
    accepted = ", ".join(f"{k}=" for k in known)
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key not in known:
            raise RecipeError(f"{prog}: unknown option '{key}'", fix=f"accepted: {accepted}")
        kind, example, optional = _kind(known[key][1])
        typed: Any = None if optional and value.strip().lower() in ("", "null", "none") else value
        try:
            OmegaConf.update(conf, key, typed, merge=False)
        except OmegaConfBaseException:
            raise RecipeError(f"{prog}: {key}={value} is not {kind}", fix=f"e.g. {key}={example}") from None
    missing = OmegaConf.missing_keys(conf)  # a set: report in the dataclass's order, the same on every run
    for key in (k for k in known if k in missing):
        raise RecipeError(f"{prog}: missing required option '{key}='", fix=f"add {key}=<value>")
    for key, (f, _) in known.items():
        minimum = f.metadata.get("min")
        value = OmegaConf.select(conf, key)
        if minimum is not None and value is not None and value < minimum:
            raise RecipeError(f"{prog}: {key}={value} must be >= {minimum}", fix=f"e.g. {key}={max(minimum, 1)}")
    return OmegaConf.to_object(conf)  # type: ignore[return-value]


__all__ = ["Args", "MISSING", "options", "positive_int", "split_args", "subcommand"]
