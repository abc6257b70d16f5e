"""Fuzz of the recipe layer: random overrides on every recipe either validate or give one RecipeError.

Overrides are drawn (seeded, so every run is the same) from every leaf key of each recipe: wrong types,
extreme and boundary numbers, nan/inf, null, unknown keys with and without ``+``, and strings with
shell syntax, quotes, newlines and NULs. Composition, validation and the layout plan run in-process
(as ``plan`` runs them); any exception other than RecipeError is a traceback the user would see, and a
valid outcome must not have accepted an unknown key. A few cases also run the real CLI for exit codes.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from typing import List, Tuple

import pytest

from fuzz_support import hostile_text
from launch_support import hydra_str
from megatron_recipes.config.compose import compose_recipe, list_recipes
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.plan.summary import build_plan
from megatron_recipes.validation.rules_values import walk
from megatron_recipes.validation.validate import validate

SEED, PER_RECIPE = 1312, 16
NUMBERS = ["0", "-1", "1", "2", "3", "7", "-0.0", "1e308", "-1e308", "9223372036854775808", "nan", "inf", "-inf",
           "1e-320", "0.5", "100000000"]
WRONG = ["abc", "true", "[1,2]", "{a:1}", "''", "null", "1.5", "'12'"]


def _leaves(recipe: str) -> List[Tuple[str, object]]:
    return [(path, value) for path, value in walk(compose_recipe(recipe)) if "[" not in path and "(a key)" not in path]


def _override(rng: random.Random, leaves) -> Tuple[str, bool]:
    """One override string, and whether it names a key the schema does not have."""
    path, value = rng.choice(leaves)
    kind = rng.choice(["number", "number", "wrong", "text", "unknown", "unknown_plus", "plus_known"])
    if kind == "number":
        return f"{path}={rng.choice(NUMBERS)}", False
    if kind == "wrong":
        return f"{path}={rng.choice(WRONG)}", False
    if kind == "text":
        return f"{path}={hydra_str(hostile_text(rng))}", False
    group = path.rsplit(".", 1)[0] if "." in path else ""
    typo = (group + "." if group else "") + rng.choice(["trian_iters", "foo", "hidden", path.rsplit(".", 1)[-1] + "s"])
    if kind == "unknown":
        return f"{typo}={rng.choice(NUMBERS + WRONG)}", True
    if kind == "unknown_plus":
        return f"+{typo}={rng.choice(NUMBERS)}", True
    return f"+{path}={rng.choice(NUMBERS)}", False  # `+` on a key that exists: Hydra refuses, one message


def _outcome(recipe: str, overrides: List[str]) -> str:
    try:
        cfg = compose_recipe(recipe, overrides)
        violations = validate(cfg)
        if violations:
            return "invalid"
        build_plan(cfg, recipe)  # what `plan` prints for a valid recipe: must not crash either
        return "valid"
    except RecipeError as exc:
        assert str(exc).strip()
        return "refused"


@pytest.mark.parametrize("recipe", list_recipes())
def test_random_overrides_validate_or_refuse(recipe):
    rng = random.Random(f"{SEED}:{recipe}")
    leaves = _leaves(recipe)
    seen = {"valid": 0, "invalid": 0, "refused": 0}
    for _ in range(PER_RECIPE):
        overrides = []
        unknown = False
        for _ in range(rng.choice([1, 1, 2])):
            text, is_unknown = _override(rng, leaves)
            overrides.append(text)
            unknown |= is_unknown
        try:
            result = _outcome(recipe, overrides)
        except Exception as exc:  # the traceback a user would have seen
            raise AssertionError(f"{recipe} {overrides!r}: {type(exc).__name__}: {exc}") from exc
        assert not (unknown and result == "valid"), f"{recipe} {overrides!r}: an unknown key was accepted"
        seen[result] += 1
    assert seen["refused"] + seen["invalid"] > 0, seen


@pytest.mark.parametrize("override", [
    "run.name='a\nb'", "+train.trian_iters=5", "model.hidden_size=0", "optimizer.lr=nan",
    f"data.tokenizer={hydra_str(chr(9) + 'x')}",  # argv cannot hold NUL; in-process cases cover it
])
def test_cli_exit_code_two_without_traceback(override, tmp_path):
    res = subprocess.run([sys.executable, "-m", "megatron_recipes.cli", "plan", "tiny_llama_cpu", override],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stderr.startswith("error: ")
