"""fp16 (and bf16) training moves the weights as far per step as fp32 does (issue 24, finding 5).

Why: megatron-core's fp16 optimizer divides the gradients by its DynamicGradScaler's scale (2**32 at the
start); only the schedule's ``config.grad_scale_func`` multiplies the loss by it. Without that hook the
gradients reach Adam 2**32 times too small, its eps dominates, and each update came out ~2e4 times too small
here (no error, no skipped step, a flat loss).

The trainer's own set-up and steps (``Trainer.setup``/``advance``) on the CPU lane (its half-precision CPU
kernels), from the same seed, constant learning rate: fp16 first skips the steps whose scaled gradients
overflow (the scale halves each time, as on a GPU), which leave the weights as they were, so its first
applied updates start from the same weights as fp32's first steps; Adam's first steps move each weight by
about the learning rate, so their sizes must agree. The rule ``machine.fp16_needs_gpu`` keeps users off fp16
on the lane; this test builds the trainer without validating, so that rule does not apply.
"""

from __future__ import annotations

from typing import Dict

import pytest

import train_support as ts
from multiproc import run_ranks

pytestmark = pytest.mark.slow

APPLIED = 2  # applied (not skipped) updates compared
MAX_STEPS = 40  # fp16 on this model skips ~22 steps (scale 2**32 -> 2**11)


def _update_sizes(run_dir: str, cache: str, precision: str) -> Dict[str, object]:
    """(rank) Norm of each applied update of the model's weights, and the steps the optimizer skipped."""
    import torch

    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import loop, sinks

    cfg = compose_recipe("tiny_llama_cpu", [
        f"run.dir={run_dir}/{precision}", f"data.cache_dir={cache}", "cluster.gpus_per_node=1",
        "cluster.nvlink_domain=1", "parallel=none", *ts.SMALL_DATA, *ts.FAST, f"precision.params_dtype={precision}",
        f"train.train_iters={MAX_STEPS}", "optimizer.lr_warmup_iters=0", "optimizer.lr_decay_style=constant",
        "checkpoint.save=false",
    ])
    trainer = loop.Trainer(cfg, distributed.init_model_parallel(cfg))
    sizes, skipped = [], 0
    try:
        trainer.setup()
        while len(sizes) < APPLIED and trainer.step < MAX_STEPS:
            before = [p.detach().float().clone() for chunk in trainer.model for p in chunk.parameters()]
            trainer.advance()  # logs every step (train_support.FAST): the log says whether it was skipped
            if sinks.step_records(trainer.run_dir / sinks.LOG_NAME)[-1]["data"]["skipped_steps"]:
                skipped += 1
                continue
            after = [p.detach().float() for chunk in trainer.model for p in chunk.parameters()]
            sizes.append(float(torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, before)))))
    finally:
        trainer.close()
    return {"sizes": sizes, "skipped": skipped}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    base = tmp_path_factory.mktemp("fp16")
    return {p: run_ranks(_update_sizes, 1, str(base), str(cache), p, timeout=900)[0] for p in ("fp32", "bf16", "fp16")}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_updates_match_fp32(runs, precision):
    fp32, half = runs["fp32"], runs[precision]
    # bf16 has no loss scaling (scale 1); fp16's 2**32 x the loss overflows first, and those steps are skipped
    assert fp32["skipped"] == 0 and (half["skipped"] > 0) == (precision == "fp16"), (fp32, half)
    assert len(half["sizes"]) == APPLIED, f"{precision} applied {len(half['sizes'])} updates in {MAX_STEPS} steps: {half}"
    for a, b in zip(half["sizes"], fp32["sizes"]):
        assert 0.8 < a / b < 1.25, f"{precision} update {a:.4g} vs fp32 {b:.4g} (all: {half} vs {fp32})"
