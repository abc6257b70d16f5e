"""Sweeps, as Hydra's multirun: with ``-m``/``--multirun``, an override with a comma list (``parallel.tp=1,2``),
``range(...)`` or ``choice(...)`` expands into one run per combination (Hydra's own override grammar
parses them, so a list value ``[a,b]`` stays one value); ``train`` runs them one after another, ``plan``
tabulates them, ``slurm submit`` submits one job per combination.

Each combination's run dir is the recipe's ``run.dir`` with the combination's overrides as a subfolder
(Hydra's ``override_dirname``: ``runs/x/parallel.tp=2,optimizer.lr=0.001``), so runs never share a folder,
checkpoints included, and a rerun of the same sweep resumes each run where it stopped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron_recipes.config.errors import RecipeError

MULTIRUN_FLAGS = ("-m", "--multirun")
MAX_COMBINATIONS = 256  # a typo such as range(0,100000) is refused rather than planned for hours


@dataclass
class Combination:
    overrides: List[str]  # the command line's overrides with each swept one replaced by its value here
    chosen: List[str]  # the swept overrides, key=value, in command-line order

    @property
    def name(self) -> str:
        """The combination as a folder name (Hydra's override_dirname)."""
        return ",".join(self.chosen).replace("/", "_") or "run"

    def with_run_dir(self, base: str) -> List[str]:
        """Its overrides with ``run.dir`` a subfolder of ``base`` named after it (unless run.dir is swept)."""
        if any(item.split("=", 1)[0] == "run.dir" for item in self.chosen):
            return list(self.overrides)
        kept = [item for item in self.overrides if item.split("=", 1)[0] != "run.dir"]
        return kept + [f"run.dir={quoted(base.rstrip('/') + '/' + self.name)}"]


def quoted(value: str) -> str:
    """A Hydra override value holding any character (a run dir named ``lr=1e-3,tp=2`` has '=' and ',')."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def take_multirun(argv: Sequence[str]) -> Tuple[List[str], bool]:
    """``argv`` without ``-m``/``--multirun``, and whether it was there."""
    rest = [a for a in argv if a not in MULTIRUN_FLAGS]
    return rest, len(rest) != len(argv)


def _parse(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise RecipeError(f"cannot read the overrides: {str(exc).splitlines()[0]}",
                          fix="key=value; a sweep is key=a,b (with -m); a list value is key=[a,b]") from None


def _top_level_items(text: str) -> List[str]:
    """``a,[b,c],'d,e'`` -> ``a``, ``[b,c]``, ``'d,e'``: the items of a simple comma list as typed."""
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def _values(typed: str, override) -> List[str]:
    """A swept override's values as the user spelled them (``1e-3`` stays ``1e-3``, run dirs are named so),
    from Hydra's parse when the text is not a plain comma list (``range(...)``, ``choice(...)``)."""
    parsed = list(override.sweep_string_iterator())
    spelled = _top_level_items(typed.split("=", 1)[1])
    return spelled if len(spelled) == len(parsed) and not typed.split("=", 1)[1].startswith(("range(", "choice(", "glob(")) else parsed


def expand(overrides: Sequence[str], multirun: bool) -> Optional[List[Combination]]:
    """The combinations of a multirun (its product, last swept key varying fastest, as Hydra orders them);
    None when this is no sweep. A sweep without ``-m`` is refused, naming the flag."""
    parsed = _parse(overrides)
    swept = [(i, o) for i, o in enumerate(parsed) if o.is_sweep_override()]
    if not swept:
        return [Combination(list(overrides), [])] if multirun else None
    if not multirun:
        raise RecipeError(f"'{overrides[swept[0][0]]}' is a sweep: several runs, one per value",
                          fix="add -m (--multirun) to run each combination, or give one value (a list value is key=[a,b])")
    choices = [[f"{o.get_key_element()}={value}" for value in _values(overrides[i], o)] for i, o in swept]
    count = 1
    for values in choices:
        count *= len(values)
    if count > MAX_COMBINATIONS:
        raise RecipeError(f"the sweep has {count} combinations (more than {MAX_COMBINATIONS})",
                          fix="sweep fewer values, or split it into several sweeps")
    out = []
    for picked in itertools.product(*choices):
        items = list(overrides)
        for (index, _), item in zip(swept, picked):
            items[index] = item
        out.append(Combination(items, list(picked)))
    return out
