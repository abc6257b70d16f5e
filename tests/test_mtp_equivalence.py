"""Multi-token prediction trains exactly like one rank: the main loss, each MTP layer's loss and the gradient norm.

The set-up of ``test_parallel_equivalence.py`` (one step-0 checkpoint every run starts from, the real trainer
on the built-in corpus, 8 sequences of 32 tokens per step in micro-batches of 2, SGD at lr 0.1, validation at
steps 3 and 6) on the tiny Llama with one MTP layer (``model.mtp_num_layers=1``). Per step, ``loss``,
``mtp_1_loss`` (log.jsonl; Megatron-LM's ``mtp_1 loss``: per-micro-batch means, averaged over micro-batches and
data-parallel ranks) and ``grad_norm`` must match the single-rank run within 1e-5 relative, and the validation
losses too, at:
- TP=2: the MTP layer's projection and its decoder layer split over two ranks;
- PP=2: the MTP layer on the last stage beside the loss, embedding with its own copy of the word embeddings;
- DP=2: each rank's MTP loss is its own micro-batches'; the logged one is their average;
- PP=3 with the layout ``Etttt|m|L``: the MTP layer alone on a middle stage (as DeepSeek-V3's recipe places
  it), its loss computed on the next stage.
"""

from __future__ import annotations

import math
from typing import Dict, List

import pytest

import train_support as ts
from test_parallel_equivalence import SGD, Experiment, assert_close

MTP = ["model.mtp_num_layers=1"]
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "pp3_mtp_stage": (3, ["parallel.pp=3", "parallel.pipeline_layout='Etttt|m|L'"]),
}
PER_STEP = ("mtp_1_loss", "grad_norm")


class MtpExperiment(Experiment):
    """An Experiment whose runs also return each step's MTP loss and gradient norm."""

    def run(self, layout: str, nproc: int, extra: List[str]) -> Dict[str, List[float]]:
        got = super().run(layout, nproc, extra)
        logged = ts.Run(0, "", self.base / layout)
        return {**got, **{key: logged.series(key) for key in PER_STEP}}


def test_loss_weight_reaches_megatron_core():
    """model.mtp_loss_scaling_factor is megatron-core's mtp_loss_scaling_factor (the recipe's, not the default)."""
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.models.transformer_config import build_transformer_config

    cfg = compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1", *MTP, "model.mtp_loss_scaling_factor=0.3"])
    config = build_transformer_config(cfg, use_te=False, cpu_init=True)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (1, 0.3)


@pytest.fixture(scope="module")
def mtp_sgd(tmp_path_factory, cache) -> MtpExperiment:
    return MtpExperiment(tmp_path_factory.mktemp("mtp"), cache, "mtp_sgd", [*SGD, *MTP])


@pytest.mark.slow
def test_single_rank_logs_its_own_mtp_loss_every_step(mtp_sgd: MtpExperiment):
    """What the layouts are compared on is there: one MTP loss per step, its own, moving with the batches."""
    ref = mtp_sgd.reference
    assert len(ref["mtp_1_loss"]) == len(ref["loss"]) and len(ref["grad_norm"]) == len(ref["loss"]), ref
    assert all(math.isfinite(v) and v > 0 for v in ref["mtp_1_loss"]), ref["mtp_1_loss"]
    assert len(set(ref["mtp_1_loss"])) == len(ref["mtp_1_loss"]), f"the MTP loss repeats: {ref['mtp_1_loss']}"
    assert all(abs(a - b) > 1e-4 for a, b in zip(ref["mtp_1_loss"], ref["loss"])), "the MTP loss is the main loss"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_layout_matches_single_rank(mtp_sgd: MtpExperiment, layout: str):
    nproc, extra = LAYOUTS[layout]
    got = mtp_sgd.run(layout, nproc, extra)
    assert_close(got, mtp_sgd.reference, 1e-5, 1e-5)
    for key in PER_STEP:
        diffs = ts.relative_diffs(got[key], mtp_sgd.reference[key])
        assert len(diffs) == len(mtp_sgd.reference["loss"]) and max(diffs) <= 1e-5, \
            f"{key}: got {got[key]}, single rank {mtp_sgd.reference[key]}; relative diffs {diffs}"
