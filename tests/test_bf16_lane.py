"""bf16 on the CPU lane: megatron-core's Float16Module, fp32 main parameters, fp32 gradient reduction.

What every GPU run uses, checked with the real trainer on gloo. All runs start from one weights-only bf16
step-0 checkpoint of the single-rank model (``checkpoint.pretrained``), the tiny corpus, 4 steps.

- Fine-tuning from a pretrained checkpoint keeps its weights: the optimizer makes its fp32 main copies
  when it is built, so weights loaded after that (without ``optimizer.reload_model_params()``) would be
  written back to the random initialisation by the first step; the checkpoint package loads them into the
  bare model before wrapping (``checkpoint.start_of``). At lr 1e-50 one step
  must leave the bf16 weights and the fp32 main copies bit-identical to the checkpoint's (at 1e-50 the
  update underflows to zero in fp32; at 1e-30 a weight that is exactly 0 would move).
- TP=2, PP=2 and DP=2 (distributed optimizer) reproduce the single-rank losses. Optimizer: Adam with
  beta1=0, eps=1e4, lr=1e3 (the update is lr/eps*g to within 1e-5: SGD at 0.1 through the distributed
  optimizer's code path, so rounding differences are not amplified by Adam's m/sqrt(v)).
  Tolerance: u / 16 = 2**-12 (2.4e-4) relative, u = 2**-8 being bf16's unit roundoff. A layout
  changes only the order in which bf16 partial sums are rounded (TP splits each contraction and
  all-reduces bf16 partial outputs; PP sends bf16 activations, which is exact), so each token's loss
  carries an independent relative error of order u; the step loss is the fp32 mean over the global
  batch's 256 tokens, which divides independent errors by sqrt(256) = 16. Measured: TP=2 2e-5, PP=2 0.
  Over the 4 steps the loss moves away from step 1's by 0.8-2% (Python 3.12's torch build / 3.11's),
  checked below to exceed 25x the tolerance.
- Resume is bit-identical: 4 steps straight equal 2 + (restart) + 2 under DP=2 with the distributed
  optimizer (its fp32 main shards and Adam moments go through the checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import train_support as ts

pytestmark = pytest.mark.slow

STEPS = 4
U_BF16 = 2.0**-8
TOLERANCE = U_BF16 / 16  # 256 loss tokens per global batch (8 sequences x 32): u / sqrt(256)
COMMON = [
    *ts.FAST,
    f"train.train_iters={STEPS}",
    "checkpoint.load=none",
    "checkpoint.save=false",
    "parallel=none",
    "precision=bf16",
]
ADAM_AS_SGD = ts.ADAM_AS_SGD
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
}



@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bf16")


@pytest.fixture(scope="module")
def init(base, cache) -> Path:
    """The one starting checkpoint of this module: bf16 weights of the single-rank model, step 0.

    Drawn with another seed than the runs', so a run that kept its own initialisation cannot pass.
    """
    return ts.initial_weights(base / "init" / "checkpoints", cache, *COMMON, "seed=7")


def test_finetune_from_pretrained_keeps_weights_bit_for_bit(base, cache, init):
    run = ts.train(
        base / "sft",
        cache,
        *COMMON,
        "train.train_iters=1",
        "optimizer.lr=1e-50",
        "optimizer.min_lr=1e-50",
        "optimizer.lr_warmup_iters=0",
        "optimizer.lr_decay_style=constant",
        "checkpoint.save=true",
        f"checkpoint.pretrained={init}",
    ).check()
    assert "versions: megatron-core 0." in run.output and "layer spec: local" in run.output, run.output[-2000:]
    start = ts.stored_tensors(init)
    after = ts.stored_tensors(base / "sft" / "checkpoints" / "iter_0000001")
    weights = sorted(k for k in start if not k.startswith("optimizer."))
    assert weights and all(start[k].dtype.is_floating_point for k in weights)
    changed = [k for k in weights if not (after[k].dtype == start[k].dtype and after[k].equal(start[k]))]
    assert not changed, f"one step at lr 1e-50 changed the pretrained weights {changed}:\n{run.output[-2000:]}"
    main = {k: after[f"optimizer.state.param.{k}"] for k in weights}
    assert all(m.dtype.is_floating_point and m.element_size() == 4 for m in main.values()), "main params not fp32"
    wrong = [k for k in weights if not main[k].equal(start[k].float())]
    assert not wrong, f"the optimizer's fp32 main parameters are not the pretrained weights: {wrong}"


@pytest.fixture(scope="module")
def reference(base, cache, init):
    return _losses(base, cache, init, "single", 1, [])


def _losses(base: Path, cache: Path, init: Path, name: str, nproc: int, extra):
    run = ts.train(base / name, cache, *COMMON, *ADAM_AS_SGD, f"checkpoint.pretrained={init}", *extra, nproc=nproc)
    losses = run.check().series("loss")
    assert len(losses) == STEPS, f"{name}: incomplete log\n{run.output[-3000:]}"
    return losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_layout_matches_single_rank(base, cache, init, reference, layout):
    nproc, extra = LAYOUTS[layout]
    got = _losses(base, cache, init, layout, nproc, extra)
    diffs = ts.relative_diffs(got, reference)
    assert all(d <= TOLERANCE for d in diffs), f"{layout}: {got} vs single rank {reference}; relative {diffs} > {TOLERANCE}"
    # the loss must move many tolerances over the run, or the comparison could not tell layouts apart
    moved = max(abs(loss - reference[0]) for loss in reference) / reference[0]
    assert moved > 25 * TOLERANCE, f"training barely moved: {reference} ({moved:.2e} relative)"


RESUME = [
    *ts.FAST,
    "parallel=none",
    "precision=bf16",
    f"train.train_iters={STEPS}",
    "optimizer.lr_warmup_iters=1",
    f"checkpoint.save_interval={STEPS // 2}",
]


def test_bf16_resume_is_bit_identical(base, cache, init):
    start = f"checkpoint.pretrained={init}"
    straight = ts.train(base / "straight", cache, *RESUME, start, nproc=2).check()
    first = ts.train(base / "halves", cache, *RESUME, start, f"train.exit_interval={STEPS // 2}", nproc=2).check()
    first_half = {key: first.series(key) for key in ("loss", "grad_norm")}  # the log grows with the second run
    assert len(first_half["loss"]) == STEPS // 2, first.output[-3000:]
    second = ts.train(base / "halves", cache, *RESUME, start, nproc=2).check()
    assert "resumed from" in second.output, second.output[-3000:]
    for key in ("loss", "grad_norm"):
        assert first_half[key] == straight.series(key)[: STEPS // 2], key
        assert second.series(key)[-(STEPS // 2):] == straight.series(key)[STEPS // 2:], key
    final = [ts.stored_tensors(r.run_dir / "checkpoints" / f"iter_{STEPS:07d}") for r in (straight, second)]
    assert not ts.differing_tensors(*final), "final checkpoints differ"
