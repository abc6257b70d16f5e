"""Per-rank RNG as Megatron-LM derives it: each pipeline stage seeds ``seed + 100 * pp_rank``.

Stages seeded alike build their layers from the same random stream, so on a PP=4 model the layers of
stages 1..3 started equal (one stage's layer a copy of the next's) and trained as copies of each other
until the data pulled them apart. The seed run (``train.train_iters=0``) writes exactly the step-0
weights, so its checkpoint shows the initialisation of every stage; the same layout seeded twice must
still give bit-identical weights (the per-rank seed is a function of the layout, not of chance).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import train_support as ts
from multiproc import run_ranks

pytestmark = pytest.mark.slow

LAYOUT = ["parallel.tp=1", "parallel.pp=4", "model.num_layers=4", "train.train_iters=0"]


def _seed_run(overrides, run_dir: str) -> int:
    """(each rank) The trainer's own entry point, as ``megatron-recipes train`` runs it on every rank."""
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.training import loop

    cfg = compose_recipe("tiny_llama_cpu", [*overrides, f"run.dir={run_dir}"])
    return loop.run(cfg, "tiny_llama_cpu")


def _seed_weights(run_dir: Path, cache: Path) -> dict:
    overrides = [*ts.SMALL_DATA, *ts.FAST, f"data.cache_dir={cache}", "cluster.gpus_per_node=4",
                 "cluster.nvlink_domain=4", *LAYOUT]
    assert run_ranks(_seed_run, 4, overrides, str(run_dir)) == [0, 0, 0, 0]
    return ts.stored_tensors(run_dir / "checkpoints" / "iter_0000000")


def test_pipeline_stages_start_with_different_layers_and_the_same_layout_repeats(tmp_path, data_cache):
    first = _seed_weights(tmp_path / "a", data_cache)
    # decoder weights stack the layers along dim 0; norms start at ones on every layer by design
    stacked = {k: v for k, v in first.items() if k.startswith("decoder.layers.") and not k.endswith("layer_norm_weight")}
    assert stacked and all(v.shape[0] == 4 for v in stacked.values()), {k: v.shape for k, v in first.items()}
    for key, layers in stacked.items():
        equal = [(a, b) for a, b in itertools.combinations(range(4), 2) if torch.equal(layers[a], layers[b])]
        assert not equal, f"{key}: layers {equal} start identical (stages seeded alike)"
    again = _seed_weights(tmp_path / "b", data_cache)
    assert set(again) == set(first)
    assert ts.differing_tensors(first, again) == []
