"""The MoE load-balancing loss trains alike at every layout and micro-batch size (CPU lane, real trainer).

The trainer uses per-token loss (``calculate_per_token_loss``): megatron-core scales the router's aux loss
by the micro-batch's token count so that dividing every gradient by the step's tokens leaves it weighted
1/(micro-batches x DP). Up to 0.18 it counted only the tokens the router sees, 1/TP of them under sequence
parallelism, and for seq_aux_loss one sequence's: the load-balancing gradient was 1/TP (x 1/micro_batch_size)
of one rank's while the LM loss matched exactly (runtime/patches/ row ``moe-aux-loss-token-count``).

Set-up as ``test_parallel_equivalence.py`` (one step-0 checkpoint, SGD at 0.1, 6 steps of 8 sequences of
32 tokens), on the tiny MoE with a large aux coefficient (0.01) so that the aux gradient shows in the norm:
- aux_loss at TP2 + SP + EP2 (ETP1, the Qwen3-235B recipe's shape) against one rank: losses and gradient
  norms within 1e-5 per step (unpatched 0.16: grad norm 2.8e-4 off at step 1, losses 1.7e-5 at step 2);
- seq_aux_loss (DeepSeek-V3's) at TP2 + SP with micro-batches of 2 against one rank with micro-batches
  of 1: the per-sequence loss makes the micro-batch size irrelevant, so both counts are checked at once.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

import train_support as ts
from test_parallel_equivalence import SGD, STEPS, Experiment, assert_close, experiment

pytestmark = pytest.mark.slow

MOE = ["model=tiny_moe", "parallel.moe_dispatcher=alltoall", "model.moe_aux_loss_coeff=0.01"]
TP2_SP = ["parallel.tp=2", "parallel.sp=true"]


def grad_norms(exp: Experiment, layout: str) -> List[float]:
    return ts.Run(0, "", exp.base / layout).series("grad_norm")


def assert_same_grad_norms(exp: Experiment, layout: str) -> None:
    got, ref = grad_norms(exp, layout), grad_norms(exp, "single")
    assert len(got) == len(ref) == STEPS, (got, ref)
    diffs = ts.relative_diffs(got, ref)
    assert max(diffs) <= 1e-5, f"grad norms {got}, single rank {ref}; relative diffs {diffs}"


def test_aux_loss_at_tp2_sp_ep2_matches_single_rank(shared_runs, cache):
    exp = experiment(shared_runs, cache, "moe_aux_loss", [*SGD, *MOE, "model.moe_router_load_balancing_type=aux_loss"])
    got: Dict[str, List[float]] = exp.run("tp2_sp_ep2", 2, [*TP2_SP, "parallel.ep=2", "parallel.etp=1"])
    assert_same_grad_norms(exp, "tp2_sp_ep2")
    assert_close(got, exp.reference, 1e-5, 1e-5)


def test_seq_aux_loss_at_tp2_sp_and_two_sequences_per_micro_batch_matches_single_rank(shared_runs, cache):
    exp = experiment(shared_runs, cache, "moe_seq_aux_loss",
                     [*SGD, *MOE, "model.moe_router_load_balancing_type=seq_aux_loss", "train.micro_batch_size=1"])
    got = exp.run("tp2_sp_mbs2", 2, [*TP2_SP, "train.micro_batch_size=2"])
    assert_same_grad_norms(exp, "tp2_sp_mbs2")
    assert_close(got, exp.reference, 1e-5, 1e-5)
