"""Context parallelism trains exactly like one rank, and resumes across CP degrees (CPU lane, real trainer).

Same set-up as ``test_parallel_equivalence.py`` (one weights-only step-0 checkpoint every run starts from,
8 sequences of 32 tokens per step, micro-batches of 2, validation at steps 3 and 6), with the local
spec's CP attention (``cp_comm_type=all_gather``):
- SGD (lr 0.1): CP=2, TP=2 x CP=2 (4 ranks) and CP=2 x PP=2 (4 ranks) match the single-rank per-step
  and validation losses within 1e-5 relative over 6 steps;
- the recipe's default Adam at CP=2: first step within 1e-5 (later ones 1e-3, as for TP/PP);
- resume: 3 steps at CP=1, saved, then 3 more at CP=2 give the losses of 6 uninterrupted CP=2 steps,
  and the reverse (CP=2 then CP=1 against the single-rank run), within 1e-5. These runs use Adam with
  beta1=0 and eps=1e4 (SGD at 0.1 through Adam's code path, as the DP=2 equivalence test does): resuming
  megatron-core's SGD optimizer fails in megatron-core itself (no ``init_state_fn`` for SGD).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

import train_support as ts
from test_parallel_equivalence import ADAM_AS_SGD, DEFAULT_ADAM, SGD, STEPS, Experiment, assert_close, experiment

pytestmark = pytest.mark.slow

CP2 = ["parallel.cp=2", "parallel.cp_comm_type=all_gather"]
CP_LAYOUTS = {
    "cp2": (2, CP2),
    "tp2_cp2": (4, ["parallel.tp=2", *CP2]),
    "cp2_pp2": (4, ["parallel.pp=2", *CP2]),
}
HALF = STEPS // 2
SAVE = ["checkpoint.save=true", "checkpoint.load=auto", f"checkpoint.save_interval={HALF}"]



@pytest.fixture(scope="module")
def sgd(shared_runs, cache) -> Experiment:
    """The same experiment (step-0 weights, single-rank reference) as test_parallel_equivalence.py's SGD one."""
    return experiment(shared_runs, cache, "sgd", SGD)


@pytest.fixture(scope="module")
def cp2_sgd(sgd) -> Dict[str, List[float]]:
    nproc, extra = CP_LAYOUTS["cp2"]
    return sgd.run("cp2", nproc, extra)


def test_cp2_matches_single_rank_sgd(sgd: Experiment, cp2_sgd):
    assert_close(cp2_sgd, sgd.reference, 1e-5, 1e-5)


@pytest.mark.parametrize("layout", ["tp2_cp2", "cp2_pp2"])
def test_cp2_with_tp_or_pp_matches_single_rank_sgd(sgd: Experiment, layout: str):
    nproc, extra = CP_LAYOUTS[layout]
    assert_close(sgd.run(layout, nproc, extra), sgd.reference, 1e-5, 1e-5)


def test_cp2_default_adam_first_step_exact(shared_runs, cache):
    adam = experiment(shared_runs, cache, "adam", DEFAULT_ADAM)
    nproc, extra = CP_LAYOUTS["cp2"]
    assert_close(adam.run("cp2", nproc, extra), adam.reference, 1e-5, 1e-3)


def _resumed(exp: Experiment, name: str, first: tuple, second: tuple) -> Dict[str, List[float]]:
    """HALF steps in layout ``first`` (nproc, overrides), saved; the rest in ``second``, same run dir."""
    run_dir = exp.base / name
    nproc, extra = first
    ts.train(run_dir, exp.cache, *exp.overrides, *SAVE, *extra, f"train.exit_interval={HALF}", nproc=nproc).check()
    nproc, extra = second
    run = ts.train(run_dir, exp.cache, *exp.overrides, *SAVE, *extra, nproc=nproc).check()
    assert f"resumed from {run_dir / 'checkpoints' / f'iter_{HALF:07d}'}" in run.output, run.output[-3000:]
    losses, vals = run.series("loss"), run.series("val_loss")
    assert len(losses) == STEPS and len(vals) == 2, f"{name}: incomplete log\n{run.output[-3000:]}"
    return {"loss": losses, "val_loss": vals}


def _assert_second_half_close(got: Dict[str, List[float]], straight: Dict[str, List[float]]) -> None:
    """Steps after the resume (and the step-6 validation) match the uninterrupted run in the new layout."""
    tail = {"loss": got["loss"][HALF:], "val_loss": got["val_loss"][1:]}
    ref = {"loss": straight["loss"][HALF:], "val_loss": straight["val_loss"][1:]}
    for key in tail:
        diffs = ts.relative_diffs(tail[key], ref[key])
        assert all(d <= 1e-5 for d in diffs), f"{key}: resumed {tail[key]}, straight {ref[key]}; relative diffs {diffs}"


@pytest.fixture(scope="module")
def resumable(shared_runs, cache) -> Experiment:
    return experiment(shared_runs, cache, "cp_resume", [*ADAM_AS_SGD, "optimizer.use_distributed_optimizer=false"])


def test_resume_cp1_checkpoint_at_cp2(resumable: Experiment):
    nproc, extra = CP_LAYOUTS["cp2"]
    straight = resumable.run("cp2", nproc, extra)
    got = _resumed(resumable, "cp1_to_cp2", (1, []), CP_LAYOUTS["cp2"])
    _assert_second_half_close(got, straight)


def test_resume_cp2_checkpoint_at_cp1(resumable: Experiment):
    got = _resumed(resumable, "cp2_to_cp1", CP_LAYOUTS["cp2"], (1, []))
    _assert_second_half_close(got, resumable.reference)
