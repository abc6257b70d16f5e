"""Every parallel layout trains exactly like one rank: per-step losses on the CPU lane, real processes.

Each run is the real trainer (``python -m megatron_recipes.train``, which starts its torchrun ranks) on
the same built-in corpus, seed and global batches (8 sequences of 32 tokens, micro-batches of 2), with
the per-step loss read from its ``log.jsonl``. Every run, the single-rank reference included, starts
from one weights-only step-0 checkpoint of the single-rank model (``checkpoint.pretrained``): pipeline
stages build different subsets of layers, so each layout's own random initialisation would differ;
megatron-core's dist-checkpointing reshards the one starting point into every layout.

Optimizers:
- SGD (lr 0.1, no momentum, no clipping) for TP=2, TP=2+SP, PP=2, PP=2+VPP=2, TP=2xPP=2 (4 ranks) and
  EP=2 (tiny MoE, alltoall dispatcher): it adds each step's gradient linearly, so float32 summation-order
  differences stay at rounding level; losses must match within 1e-5 relative over 6 steps.
- DP=2 with the distributed optimizer: megatron-core's distributed optimizer only shards Adam, so it runs
  Adam with beta1=0 and eps=1e4 (lr 1e3): the update lr*g/(sqrt(v)+eps) is then lr/eps*g to within
  1e-5, i.e. SGD at 0.1 through the distributed optimizer's own code path; 1e-5 relative.
- The recipe's default Adam (betas 0.9/0.95, eps 1e-8, wd 0.01, clip 1.0; one warm-up step) for TP=2 and
  PP=2: its m/sqrt(v) normalisation amplifies rounding, so the first step must match within 1e-5 and
  the later ones within 1e-3.
Validation losses (forward-only schedules) are compared at steps 3 and 6 with the same tolerances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

import train_support as ts

pytestmark = pytest.mark.slow

STEPS = 6
COMMON = [
    *ts.FAST,
    f"train.train_iters={STEPS}",
    "logging.eval_interval=3",
    "logging.eval_iters=1",
    "checkpoint.save=false",
    "checkpoint.load=none",
    "parallel=none",
    "precision=fp32",
]
# Every optimizer field is set here: the recipe's own optimizer values would otherwise override the group's.
SGD = [
    "optimizer=sgd",
    "optimizer.lr=0.1",
    "optimizer.min_lr=0.1",
    "optimizer.weight_decay=0.0",
    "optimizer.sgd_momentum=0.0",
    "optimizer.clip_grad=0.0",
    "optimizer.lr_warmup_iters=0",
    "optimizer.lr_decay_style=constant",
    "optimizer.use_distributed_optimizer=false",
]
ADAM_AS_SGD = ts.ADAM_AS_SGD
DEFAULT_ADAM = ["optimizer=adam", "optimizer.lr=3.0e-3", "optimizer.lr_warmup_iters=1"]

DENSE_LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    # 4 layers over 3 stages only with the embedding and the loss counted as layers (as Llama 3.1 405B's
    # 126 over 8 x 8): [emb, 0] [1, 2] [3, loss]; the trainer must build what the planner places
    "pp3_counted": (3, ["parallel.pp=3", "parallel.account_for_embedding_in_pipeline_split=true",
                        "parallel.account_for_loss_in_pipeline_split=true"]),
    # a custom pipeline layout (megatron-core's pipeline_model_parallel_layout), uneven and interleaved: rank 0
    # holds [emb, 0] and [3], rank 1 holds [1, 2] and a last chunk with the loss alone
    "pp2_vpp2_layout": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout='Et|tt|t|L'"]),
}


class Experiment:
    """One model + optimizer setting: its step-0 weights, its single-rank reference, then any layout."""

    def __init__(self, base: Path, cache: Path, name: str, overrides: Sequence[str], recipe: str = "tiny_llama_cpu",
                 init: Optional[Path] = None):
        self.base, self.cache, self.name, self.recipe = base / name, cache, name, recipe
        self.overrides = [*COMMON, *overrides]
        if init is None:
            init = ts.initial_weights(self.base / "init" / "checkpoints", cache, *self.overrides, recipe=recipe)
        self.overrides.append(f"checkpoint.pretrained={init}")
        self.reference = self.run("single", 1, [])

    def run(self, layout: str, nproc: int, extra: List[str]) -> Dict[str, List[float]]:
        run = ts.train(self.base / layout, self.cache, *self.overrides, *extra, nproc=nproc, recipe=self.recipe).check()
        losses, vals = run.series("loss"), run.series("val_loss")
        assert len(losses) == STEPS and len(vals) == 2, f"{self.name}/{layout}: incomplete log\n{run.output[-3000:]}"
        return {"loss": losses, "val_loss": vals}


def assert_close(got: Dict[str, List[float]], ref: Dict[str, List[float]], first: float, later: float) -> None:
    for key in ("loss", "val_loss"):
        diffs = ts.relative_diffs(got[key], ref[key])
        limits = [first] + [later] * (len(diffs) - 1) if key == "loss" else [later] * len(diffs)
        bad = [(i, d, lim) for i, (d, lim) in enumerate(zip(diffs, limits)) if not d <= lim]
        assert not bad, f"{key}: got {got[key]}, single rank {ref[key]}; relative diffs {diffs} (limits {limits})"
    assert ref["loss"][-1] != ref["loss"][0], "training did not change the loss: the comparison would be vacuous"


def experiment(shared_runs, cache: Path, name: str, overrides: Sequence[str], recipe: str = "tiny_llama_cpu") -> Experiment:
    """The Experiment of ``recipe`` + ``overrides``, built once per session (conftest ``shared_runs``).

    Same recipe, overrides and data give the same step-0 weights and single-rank losses, so every module
    asking for them (this one, test_context_parallel_training.py) compares against one reference run.
    The step-0 checkpoint is shared more widely, by every setting with the same model: the optimizer
    settings do not enter the initial weights (it is a weights-only checkpoint, built before any optimizer).
    """
    full = [*COMMON, *overrides]
    model_key = tuple(o for o in full if not o.startswith("optimizer"))

    def init() -> Path:
        return ts.initial_weights(shared_runs.folder(f"{name}_init") / "checkpoints", cache, *full, recipe=recipe)

    start = shared_runs.get(("init", recipe, model_key, str(cache)), init)
    return shared_runs.get(("experiment", recipe, tuple(full), str(cache)),
                           lambda: Experiment(shared_runs.folder(name), cache, name, overrides, recipe, init=start))



@pytest.fixture(scope="module")
def dense_sgd(shared_runs, cache) -> Experiment:
    return experiment(shared_runs, cache, "sgd", SGD)


@pytest.mark.parametrize("layout", list(DENSE_LAYOUTS))
def test_dense_layout_matches_single_rank_sgd(dense_sgd: Experiment, layout: str):
    nproc, extra = DENSE_LAYOUTS[layout]
    got = dense_sgd.run(layout, nproc, extra)
    assert_close(got, dense_sgd.reference, 1e-5, 1e-5)


def test_ep2_moe_alltoall_matches_single_rank_sgd(shared_runs, cache):
    moe = experiment(shared_runs, cache, "moe_sgd", [*SGD, "model=tiny_moe", "parallel.moe_dispatcher=alltoall"])
    got = moe.run("ep2", 2, ["parallel.ep=2"])
    assert_close(got, moe.reference, 1e-5, 1e-5)


def test_dp2_distributed_optimizer_matches_single_rank(shared_runs, cache):
    exp = experiment(shared_runs, cache, "dp2_distopt", ADAM_AS_SGD)
    got = exp.run("dp2", 2, [])
    assert_close(got, exp.reference, 1e-5, 1e-5)


@pytest.fixture(scope="module")
def dense_adam(shared_runs, cache) -> Experiment:
    return experiment(shared_runs, cache, "adam", DEFAULT_ADAM)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_default_adam_first_step_exact_later_close(dense_adam: Experiment, layout: str):
    nproc, extra = DENSE_LAYOUTS[layout]
    got = dense_adam.run(layout, nproc, extra)
    assert_close(got, dense_adam.reference, 1e-5, 1e-3)
