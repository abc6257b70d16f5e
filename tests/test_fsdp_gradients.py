"""Megatron-FSDP trains exactly like megatron-core DDP where its gradient buffer is unsharded: on one rank
(every mode) and under zero1 (any DP size).

Why: megatron-core 0.16 reduced an unsharded gradient buffer into a copy and added it back, and zero1 without
``overlap_grad_reduce`` reduced it a second time in ``finish_grad_sync``: gradients x2 per reduction on one rank
(x9.6 here with 4 micro-batches under zero3), x2 under zero1, silently; patch row ``fsdp-unsharded-grad-reduce``
(runtime/patches/) corrects it. Adam hides a uniform factor, so the runs use Adam stepping like SGD
(``ADAM_AS_SGD``): the update is the gradient, and the logged gradient norm and the step-2 loss show any factor.
Same weights (``set_base_weights``), same global batches of 8 (4 micro-batches on one rank, 2 per rank at
DP=2: gradient accumulation), two steps, compared with one-rank DDP.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest

import train_support as ts
from multiproc import run_ranks

pytestmark = pytest.mark.slow

STEPS = 2
OVERRIDES = [*ts.ADAM_AS_SGD, "precision=fp32", "train.global_batch_size=8", "train.micro_batch_size=2"]
FSDP = ["parallel.fsdp=true"]
MODES = {  # name: (ranks, overrides)
    "dp1_zero3": (1, [*FSDP, "parallel.sharding=zero3"]),  # grad norm was x9.6
    "dp1_zero1": (1, [*FSDP, "parallel.sharding=zero1"]),  # x2
    "dp2_zero1": (2, [*FSDP, "parallel.sharding=zero1"]),  # x2
    "dp2_zero1_overlap": (2, [*FSDP, "parallel.sharding=zero1", "parallel.overlap_grad_reduce=true"]),  # own + sum
}


def train_steps(world: int, overrides: List[str], steps: int) -> List[Tuple[float, float]]:
    """(loss, grad norm) of each step, from the fixed starting model, wrapped as the trainer wraps it."""
    import torch

    import peft_support as ps
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime.distributed import init_model_parallel
    from megatron_recipes.training import optim, step

    cfg = ps.tiny_cfg(world, *overrides)
    init_model_parallel(cfg)
    chunks = build_model_chunks(cfg)
    ps.set_base_weights(chunks)
    model = optim.wrap_model(cfg, chunks)
    optimizer = optim.build_optimizer(cfg, model)
    scheduler = optim.build_scheduler(cfg, optimizer)
    optim.configure_schedule_hooks(cfg, model, optimizer)
    forward_step = step.make_forward_step(torch.device("cpu"), use_te=False)
    batches = ps.fixed_batches(cfg, steps)
    per_step = len(batches) // steps
    out = []
    for s in range(steps):
        its = [iter(batches[s * per_step : (s + 1) * per_step]) for _ in model]
        result = step.train_step(cfg, model, optimizer, scheduler, its, forward_step, torch.device("cpu"))
        out.append((result.loss, result.grad_norm))
    return out


def _run(world: int, *extra: str) -> List[List[Tuple[float, float]]]:
    """Each rank's (loss, grad norm) per step."""
    return run_ranks(train_steps, world, world, [*OVERRIDES, *extra], STEPS, timeout=900)


@pytest.fixture(scope="module")
def ddp() -> List[Tuple[float, float]]:
    return _run(1)[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_unsharded_fsdp_grads_match_ddp(ddp, mode):
    world, overrides = MODES[mode]
    ranks = _run(world, *overrides)
    (loss1, norm1), (loss2, _) = ddp
    assert loss2 != loss1 and norm1 > 0, ddp  # training moved the model: the comparison is not vacuous
    assert len(ranks) == world
    for got in ranks:
        assert len(got) == len(ddp) == STEPS
        for (g_loss, g_norm), (r_loss, r_norm) in zip(got, ddp):
            assert g_norm == pytest.approx(r_norm, rel=1e-6), (mode, got, ddp)
            assert g_loss == pytest.approx(r_loss, rel=1e-6), (mode, got, ddp)
