"""ZeRO-style sharding on the CPU lane: each mode trains like one rank, and allocates what `plan` says.

Every run starts from one model (``set_base_weights``: each tensor drawn from its layout-free name, so
every layout holds the same weights) and the same global batches, with the tiny Llama's default AdamW
(lr 1e-2, 3 steps, global batches of 8: two micro-batches per rank at DP=2). Losses must match the single-rank run within 1e-5 relative on the first step and
1e-4 after (Adam's m/sqrt(v) amplifies float32 summation-order differences).

The same runs read the bytes megatron-core allocated on each rank (parameter/gradient buffers, optimizer
state; ``sharding_support.allocated_state_bytes``) and compare them with the planner's estimate
(``estimate.memory.model_state_bytes``): within 5%.

Modes: Megatron-FSDP zero1/zero2/zero3 (fp32, and zero3 in bf16), hybrid sharding of the distributed
optimizer (2 instances), and TP=2 x FSDP zero3 (4 ranks). Megatron-FSDP with 2 instances (HSDP) gets twice
the one-rank gradients here: the rule table refuses it, and a test records the mismatch. Optimizer and activation offload
need a GPU (rule offload.needs_gpu).
"""

from __future__ import annotations

from typing import Dict, List

import pytest

import sharding_support as ss
from multiproc import run_ranks
from sharding_support import sharding_cfg

pytestmark = pytest.mark.slow

STEPS = 3
FSDP = ["parallel.fsdp=true"]
MODES: Dict[str, List[str]] = {
    "fsdp_zero1": FSDP + ["parallel.sharding=zero1"],
    "fsdp_zero2": FSDP + ["parallel.sharding=zero2"],
    "fsdp_zero3": FSDP + ["parallel.sharding=zero3"],
    "distopt_2_instances": ["parallel.dist_optimizer_instances=2"],
}
# Megatron-FSDP zero3 with 2 instances (HSDP) gets twice the one-rank gradients, without an error: refused by
# rule fsdp.no_hybrid_instances; a test shows why.
HSDP = FSDP + ["parallel.sharding=zero3", "parallel.dist_optimizer_instances=2"]


def _run(world: int, overrides: List[str]) -> List[dict]:
    return run_ranks(ss.train_and_measure, world, world, overrides, STEPS, timeout=900)


@pytest.fixture(scope="module")
def reference() -> Dict[str, List[float]]:
    return {dtype: _run(1, [f"precision={dtype}"])[0]["losses"] for dtype in ("fp32", "bf16")}


def _assert_matches(got: List[float], ref: List[float]) -> None:
    assert ref[-1] != ref[0], "training did not change the loss: the comparison would be vacuous"
    diffs = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
    limits = [1e-5] + [1e-4] * (len(ref) - 1)
    assert len(got) == len(ref) and all(d <= lim for d, lim in zip(diffs, limits)), (got, ref, diffs)


def _assert_estimate(overrides: List[str], allocated: Dict[str, int], world: int = 2) -> None:
    from megatron_recipes.estimate.memory import model_state_bytes
    from megatron_recipes.estimate.params import stage_params

    cfg = sharding_cfg(world, *overrides)
    weights, grads, opt = model_state_bytes(cfg, stage_params(cfg, 0))
    for name, est in (("weights", weights), ("grads", grads), ("optimizer", opt)):
        assert abs(allocated[name] - est) <= 0.05 * est, f"{name}: allocated {allocated[name]} B, estimated {est:.0f} B"


@pytest.mark.parametrize("mode", list(MODES))
def test_sharding_mode_matches_single_rank_and_estimate(reference, mode):
    overrides = ["precision=fp32", *MODES[mode]]
    ranks = _run(2, overrides)
    for r in ranks:
        _assert_matches(r["losses"], reference["fp32"])
        _assert_estimate(overrides, r["allocated"])


def test_fsdp_zero3_bf16_matches_single_rank_and_estimate(reference):
    overrides = ["precision=bf16", *MODES["fsdp_zero3"]]
    ranks = _run(2, overrides)
    for r in ranks:
        _assert_matches(r["losses"], reference["bf16"])
        _assert_estimate(overrides, r["allocated"])


def test_fsdp_zero3_with_tp2_matches_single_rank_and_estimate(reference):
    """4 ranks: TP=2 x Megatron-FSDP zero3 over DP=2."""
    overrides = ["precision=fp32", "parallel.tp=2", *MODES["fsdp_zero3"]]
    ranks = run_ranks(ss.train_and_measure, 4, 4, overrides, STEPS, timeout=1200)
    for r in ranks:
        _assert_matches(r["losses"], reference["fp32"])
        _assert_estimate(overrides, r["allocated"], world=4)


def test_hsdp_is_refused_because_it_diverges_from_single_rank():
    """Why rule fsdp.no_hybrid_instances exists: megatron-core runs it (the rule is skipped here) but its
    gradient norm is not the one-rank run's (Adam as SGD shows it; AdamW hides a uniform factor). Before
    patch row fsdp-unsharded-grad-reduce the losses drifted under AdamW too. If this starts to match, lift the rule."""
    from megatron_recipes.validation.validate import validate
    from test_fsdp_gradients import OVERRIDES, train_steps

    assert "fsdp.no_hybrid_instances" in [v.rule_id for v in validate(sharding_cfg(2, *HSDP, "checkpoint.save=false",
                                                                                   "checkpoint.load=none"))]
    hsdp = run_ranks(train_steps, 2, 2, [*OVERRIDES, *HSDP], 1, timeout=900)[0]
    single = run_ranks(train_steps, 1, 1, OVERRIDES, 1, timeout=900)[0]
    assert hsdp[0][0] == pytest.approx(single[0][0], rel=1e-6)  # same loss: same weights and data
    # gradient norm off: x2 while the schedule hooks followed Megatron-FSDP's rewritten overlap flags, 0.74x
    # since they follow the recipe as Megatron-LM does (issue 24); either way not the one-rank run's
    assert hsdp[0][1] != pytest.approx(single[0][1], rel=1e-2), (hsdp, single)


def test_zero1_estimate_would_miss_fsdp_sharding():
    """The estimate distinguishes the modes: zero3 state per rank is below zero1's (a check that can fail)."""
    from megatron_recipes.estimate.memory import model_state_bytes
    from megatron_recipes.estimate.params import stage_params

    z1 = sharding_cfg(2, "precision=bf16")
    z3 = sharding_cfg(2, "precision=bf16", *MODES["fsdp_zero3"])
    w1, g1, _ = model_state_bytes(z1, stage_params(z1, 0))
    w3, g3, _ = model_state_bytes(z3, stage_params(z3, 0))
    assert w3 == pytest.approx(w1 / 2) and g3 == pytest.approx(g1 / 2)


def test_trainer_fsdp_zero3_from_pretrained_matches_single_rank(tmp_path, data_cache):
    """The real trainer (its own torchrun ranks, built-in data): Megatron-FSDP zero3 over DP=2, started from a
    single-rank step-0 checkpoint (loaded into the bare model before sharding), trains like one rank."""
    import train_support as ts

    common = [*ts.FAST, "train.train_iters=3", "logging.eval_interval=3", "logging.eval_iters=1",
              "checkpoint.save=false", "checkpoint.load=none", "parallel=none", "precision=fp32",
              "optimizer.lr=3.0e-3", "optimizer.lr_warmup_iters=1"]
    cache = data_cache  # the session's built-in corpus (tests/conftest.py)
    init = ts.initial_weights(tmp_path / "init" / "checkpoints", cache, *common)
    common.append(f"checkpoint.pretrained={init}")
    single = ts.train(tmp_path / "single", cache, *common, nproc=1).check()
    fsdp = ts.train(tmp_path / "fsdp", cache, *common, "parallel.fsdp=true", "parallel.sharding=zero3", nproc=2).check()
    assert "before Megatron-FSDP sharding" in fsdp.output
    _assert_matches(fsdp.series("loss"), single.series("loss"))
    val, ref = fsdp.series("val_loss"), single.series("val_loss")
    assert len(val) == len(ref) == 1 and ts.relative_diffs(val, ref)[0] <= 1e-4, (val, ref)
