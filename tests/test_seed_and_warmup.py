"""Shorter runs need no second override (warm-up as a fraction), and `train.train_iters=0` writes the
step-0 seed checkpoint that makes two layouts comparable step for step (README's flow)."""

from __future__ import annotations

from pathlib import Path

import pytest

import train_support as ts
from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe, list_recipes
from megatron_recipes.validation.validate import validate


def test_warmup_fraction_floors_over_the_decay_horizon():
    cfg = compose_recipe("tiny_llama_cpu", [])
    assert cfg.optimizer.lr_warmup_iters is None and derived.lr_warmup_iters(cfg) == 20  # 0.0667 x 300
    assert derived.lr_warmup_iters(compose_recipe("tiny_llama_cpu", ["train.train_iters=6"])) == 0
    assert derived.lr_warmup_iters(compose_recipe("tiny_llama_cpu", ["train.train_iters=60"])) == 4
    big = compose_recipe("llama3_8b_pretrain", [])
    assert derived.lr_warmup_iters(big) == 2000  # 0.02 x 100,000: the recipe's previous absolute value


def test_absolute_warmup_wins_and_is_still_validated():
    cfg = compose_recipe("tiny_llama_cpu", ["optimizer.lr_warmup_iters=7"])
    assert derived.lr_warmup_iters(cfg) == 7
    bad = compose_recipe("tiny_llama_cpu", ["optimizer.lr_warmup_iters=6", "train.train_iters=6"])
    assert "optimizer.schedule" in {v.rule_id for v in validate(bad)}


def _cpu_recipes():
    return [r for r in list_recipes() if compose_recipe(r, []).cluster.gpu_arch == "cpu"]


def test_every_cpu_recipe_takes_a_six_step_run_with_no_other_override():
    recipes = _cpu_recipes()
    assert "tiny_llama_cpu" in recipes and "tiny_llama_lora" in recipes
    for recipe in recipes:
        found = [f"[{v.rule_id}] {v.message}" for v in validate(compose_recipe(recipe, ["train.train_iters=6"]))]
        assert not found, f"{recipe}: {found}"


def test_every_shipped_recipe_uses_a_warmup_fraction():
    for recipe in list_recipes():
        o = compose_recipe(recipe, []).optimizer
        assert o.lr_warmup_fraction is not None and o.lr_warmup_iters is None, recipe


@pytest.mark.slow
def test_seed_checkpoint_makes_two_layouts_start_equal(tmp_path, data_cache):
    cache = data_cache  # the session's built-in corpus (tests/conftest.py)
    base = [*ts.FAST, "precision=fp32", "model.vocab_size=768"]  # no padding at TP=1 or TP=2
    common = [*base, "train.train_iters=1", "checkpoint.save=false"]
    seed = ts.train(tmp_path / "seed", cache, *base, "train.train_iters=0", "parallel=none", nproc=1).check()
    assert "seed checkpoint" in seed.output
    ckpt = tmp_path / "seed" / "checkpoints" / "iter_0000000"
    assert (ckpt / "meta.json").is_file()
    runs = {}
    for name, nproc, layout in (("one", 1, ["parallel=none"]), ("tp2", 2, ["parallel=tp2"]), ("pp2", 2, ["parallel=pp2"])):
        runs[name] = ts.train(tmp_path / name, cache, *common, *layout, f"checkpoint.pretrained={ckpt.parent}",
                              nproc=nproc).check().series("loss")
    assert len(runs["one"]) == 1
    for name in ("tp2", "pp2"):
        assert ts.relative_diffs(runs[name], runs["one"])[0] <= 1e-5, runs
    # the same run.dir: the next run starts from its own seed's weights
    again = ts.train(tmp_path / "seed", cache, *common, "parallel=none", nproc=1).check()
    assert "initial weights from this run's seed checkpoint" in again.output
    assert ts.relative_diffs(again.series("loss"), runs["one"])[0] <= 1e-6


def test_full_sft_seed_needs_no_pretrained_checkpoint():
    """A seed run (train_iters=0) of an SFT recipe trains nothing, so it must not ask for starting weights
    (``check`` makes its step-0 checkpoint this way); one that trains still must."""
    seed = ["peft=none", "checkpoint.pretrained=null", "train.train_iters=0"]
    ids = [v.rule_id for v in validate(compose_recipe("tiny_llama_sft", seed))]
    assert "peft.needs_pretrained" not in ids, ids
    trains = [v.rule_id for v in validate(compose_recipe("tiny_llama_sft", seed[:2] + ["train.train_iters=6"]))]
    assert "peft.needs_pretrained" in trains, trains
