"""Rules on single values, whatever field they sit in: text without control characters, finite numbers.

Why: every string of a recipe may end up in a generated shell script (``slurm render`` writes names,
paths and overrides into comments, ``#SBATCH`` lines and quoted words). A newline there starts a new
script line, one that bash runs and that also ends sbatch's reading of later ``#SBATCH`` lines. No
field has a use for control characters, so they are refused everywhere rather than escaped per field.
A NaN or infinite number passes every ``<``/``>`` comparison the other rules make, so it is refused
here once instead of in each of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterator, Optional, Tuple

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import rule

CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def walk(value: Any, path: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted path, leaf value) for every leaf of a config, list items and dict keys included."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from walk(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path} (a key)", key
            yield from walk(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from walk(item, f"{path}[{i}]")
    else:
        yield path, value


def control_characters(text: str) -> Optional[str]:
    """A readable name of the first control character in ``text``, or None."""
    found = CONTROL.search(text)
    return None if found is None else repr(found.group(0))


@rule(
    "text.control_characters",
    ["every string value"],
    "no string value holds a control character (newline, carriage return, tab, NUL, escape...)",
    "remove the character; names, paths and options are single lines of printable text",
)
def _no_control_characters(cfg: RunConfig) -> Optional[str]:
    bad = [f"{path}={value!r} holds {control_characters(value)}" for path, value in walk(cfg)
           if isinstance(value, str) and control_characters(value)]
    return "; ".join(bad[:4]) + ("; ..." if len(bad) > 4 else "") if bad else None


@rule(
    "values.finite",
    ["every number"],
    "every number is finite (no nan, inf or -inf)",
    "give a finite value",
)
def _finite(cfg: RunConfig) -> Optional[str]:
    bad = [f"{path}={value}" for path, value in walk(cfg)
           if isinstance(value, float) and not math.isfinite(value)]
    return f"{', '.join(bad[:6])} must be finite" if bad else None


VALUE_RULES = [_no_control_characters, _finite]
