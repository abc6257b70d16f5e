"""The issue's probes on the recipe layer: each bad input is one RecipeError (exit 2), never a traceback
or a silently dropped key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.families import all_families
from megatron_recipes.validation.rules_model import FAMILIES
from megatron_recipes.validation.validate import validate_or_raise

TINY = "tiny_llama_cpu"


def _refused(recipe: str, overrides=()) -> str:
    with pytest.raises(RecipeError) as info:
        validate_or_raise(compose_recipe(recipe, list(overrides)), recipe)
    return str(info.value)


@pytest.mark.parametrize("content, expected", [
    (b"defaults:\n  - run_schema\nmodel: [\n", "not valid YAML at line"),  # syntax error
    (b"", "is not a recipe"),  # empty
    (b"model:\n  hidden_size: 4\n", "is not a recipe"),  # no defaults list
    (bytes(range(256)) * 4, "not UTF-8 text"),  # binary
])
def test_broken_recipe_files(tmp_path, content, expected):
    path = tmp_path / "mine.yaml"
    path.write_bytes(content)
    assert expected in _refused(str(path))


def test_broken_recipe_file_exits_2_on_the_cli(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_bytes(b"a: [\n")
    res = subprocess.run([sys.executable, "-m", "megatron_recipes.cli", "plan", str(path)], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "line 2" in res.stderr


@pytest.mark.parametrize("override", ["+train.trian_iters=5", "+model.foo=1", "+foo=1"])
def test_unknown_keys_with_plus_are_refused(override):
    key = override[1:].split("=")[0]
    assert f"unknown key(s) {key}" in _refused(TINY, [override])


def test_plus_still_adds_to_dict_fields():
    assert compose_recipe(TINY, ["+cluster.env.MY_FLAG=1"]).cluster.env["MY_FLAG"] == "1"


@pytest.mark.parametrize("override, expected", [
    ("model.hidden_size=0", "[model.sizes_positive]"),
    ("model.num_layers=-1", "[model.sizes_positive]"),
    ("model.rope_scaling.factor=2", "which is null in recipe"),
    ("model.family=gpt9", "[model.family]"),
    ("optimizer.lr=inf", "[values.finite]"),
    ("data.split='949,50,inf'", "[data.split]"),  # was accepted and became [0.95, 0.05, 0.0] (issue 30, case 12)
    ("data.split='nan,50,1'", "[data.split]"),
])
def test_bad_values_are_refused(override, expected):
    assert expected in _refused(TINY, [override])


def test_family_rule_matches_the_conversion_mappings():
    assert sorted(FAMILIES) == sorted(all_families())
    # and no family module is left out of the list (it would never be converted or tested)
    import megatron_recipes.families as package

    declaring = {p.stem for p in Path(package.__file__).parent.glob("*.py") if "\nFAMILY = " in p.read_text()}
    assert declaring == set(FAMILIES), declaring ^ set(FAMILIES)


def test_each_family_carries_a_tiny_hf_config_of_its_own_model_type():
    for name, family in all_families().items():
        assert family.tiny_hf_config().model_type == family.model_type, name


# --- deletion targets (issue 30: the tool deletes only what it wrote) ---------------------------------
def test_the_deletion_rule_over_every_kind_of_target(tmp_path):
    """Each target is either one the tool may replace, or refused with nothing under ``tmp_path`` changed."""
    from fuzz_support import deletion_targets, snapshot
    from megatron_recipes import files

    for name, path, may_go in deletion_targets(tmp_path / "zoo", "check"):
        before = snapshot(tmp_path)
        if may_go:
            files.fresh_own_dir(path, "check", "--dir")
            assert files.own_kind(path) == "check" and [p.name for p in path.iterdir()] == [files.OWN_MARKER], name
            continue
        with pytest.raises(RecipeError) as info:
            files.fresh_own_dir(path, "check", "--dir")
        assert "--dir" in info.value.message and info.value.fix, name
        assert snapshot(tmp_path) == before, f"{name}: refused, yet something changed"


def test_atomic_writes_over_every_kind_of_target(tmp_path):
    """A file write replaces only a regular file (or creates one); anything else is refused untouched."""
    from fuzz_support import deletion_targets, snapshot
    from megatron_recipes import files

    for name, path, _ in deletion_targets(tmp_path / "zoo", "report"):
        before = snapshot(tmp_path)
        try:
            files.write_text(path, "new page")
        except RecipeError as exc:
            assert "regular files" in exc.message and snapshot(tmp_path) == before, name
        else:
            assert name in ("regular file", "absent") and path.read_text() == "new page", name


@pytest.mark.parametrize("name", __import__("fuzz_support").UPWARD_NAMES)
def test_check_output_never_climbs_upward_from_a_run_name(tmp_path, monkeypatch, name):
    import dataclasses

    from megatron_recipes.check.cli import output_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "keep").mkdir(parents=True)
    (tmp_path / "runs" / "keep" / "log.jsonl").write_text("{}\n")
    cfg = compose_recipe(TINY, [])
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))
    try:
        out = output_dir(cfg, None)
    except RecipeError as exc:
        assert "run.name" in exc.message
    else:
        assert ".." not in Path(f"runs/check/{name}").parts and out.is_relative_to(tmp_path / "runs" / "check"), out
    assert (tmp_path / "runs" / "keep" / "log.jsonl").is_file()
