"""The trainer's pure parts: peak memory, the LR schedule, optimizer mapping, log sinks and the loss plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.training import metrics, optim, sinks


def _cfg(*overrides):
    return compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1", *overrides])


def test_peak_memory_is_positive_on_cpu():
    assert 0.01 < metrics.peak_memory_gib() < 1024


class _FakeOptimizer:
    """OptimizerParamScheduler only touches ``param_groups``."""

    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0, "params": []}]


def _lrs(cfg, steps):
    sched = optim.build_scheduler(cfg, _FakeOptimizer())
    out = []
    for _ in range(steps):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def test_warmup_then_cosine_decay_to_min_lr():
    cfg = _cfg("optimizer.lr=1.0", "optimizer.min_lr=0.1", "optimizer.lr_warmup_iters=4", "train.train_iters=14")
    lrs = _lrs(cfg, 16)
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    mid = 4 + 5  # halfway through the 10 decay steps: cosine gives the mean of max and min
    assert lrs[mid] == pytest.approx(0.55)
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)


def test_linear_and_constant_decay():
    lin = _lrs(_cfg("optimizer.lr=1.0", "optimizer.min_lr=0.0", "optimizer.lr_warmup_iters=0",
                    "optimizer.lr_decay_style=linear", "train.train_iters=10"), 11)
    assert lin == pytest.approx([1.0 - 0.1 * i for i in range(11)])
    const = _lrs(_cfg("optimizer.lr=0.3", "optimizer.lr_warmup_iters=0", "optimizer.lr_decay_style=constant"), 5)
    assert const == pytest.approx([0.3] * 5)


def test_optimizer_mapping():
    cfg = _cfg("optimizer.clip_grad=0.0")
    oc = optim.optimizer_config(cfg)
    assert math.isinf(oc.clip_grad) and oc.optimizer == "adam" and oc.use_distributed_optimizer
    with pytest.raises(RecipeError, match="use_distributed_optimizer=false"):
        optim.optimizer_config(_cfg("optimizer=sgd", "optimizer.use_distributed_optimizer=true"))
    sgd = optim.optimizer_config(_cfg("optimizer=sgd", "optimizer.sgd_momentum=0.5"))
    assert sgd.optimizer == "sgd" and sgd.sgd_momentum == 0.5 and not sgd.use_distributed_optimizer


def test_log_is_dllogger_jsonl_and_resume_drops_repeated_steps(tmp_path: Path):
    log = sinks.MetricsLog(tmp_path, resume_step=0)
    log.metadata("run", {"layout": "TP=2"})
    for step in range(1, 6):
        log.log(step, {"loss": 10.0 - step, "lr": 0.1, "grad_norm": float("nan") if step == 5 else 1.0, "tokens_per_sec": 5.0})
    log.close()
    lines = (tmp_path / sinks.LOG_NAME).read_text().splitlines()
    records = [json.loads(line) for line in lines]  # NaN is written so that every line still parses
    assert records[0]["type"] == "METADATA" and records[-1]["data"]["grad_norm"] == "nan"
    assert {"timestamp", "datetime", "elapsedtime", "type", "step", "data"} <= set(records[1])

    resumed = sinks.MetricsLog(tmp_path, resume_step=3)  # the checkpoint was at step 3
    resumed.log(4, {"loss": 0.5})
    resumed.close()
    steps = sinks.step_records(tmp_path / sinks.LOG_NAME)
    assert [(r["step"], r["data"]["loss"]) for r in steps] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]


def test_read_log_accepts_dllogger_prefixed_lines(tmp_path: Path):
    path = tmp_path / "dll.json"
    path.write_text('DLLL {"type": "LOG", "step": 7, "data": {"loss": 1.5}}\n')
    assert sinks.step_records(path)[0]["data"]["loss"] == 1.5


def test_loss_plot_is_a_png(tmp_path: Path):
    log = sinks.MetricsLog(tmp_path, resume_step=0)
    for step in range(1, 11):
        log.log(step, {"loss": 5.0 / step, **({"val_loss": 6.0 / step} if step % 5 == 0 else {})})
    log.close()
    out = sinks.plot_losses(tmp_path / sinks.LOG_NAME, tmp_path / sinks.PLOT_NAME, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_an_evaluation_alone_does_not_reset_the_logging_window(tmp_path):
    """log_interval=4, eval_interval=2: the step-4 line averages steps 1-4, though step 2 only evaluated."""
    from megatron_recipes.training import loop, step

    trainer = loop.Trainer.__new__(loop.Trainer)  # the bookkeeping only: no model, no process group
    trainer.cfg = _cfg("logging.log_interval=4", "logging.eval_interval=2", "logging.eval_iters=1", "train.train_iters=8")
    trainer.step, trainer.consumed_samples, trainer.is_logger = 0, 0, False
    trainer.window, trainer.valid_ds = loop.Window(), object()
    trainer.sink = sinks.MetricsLog(tmp_path, 0)
    trainer.evaluate_metrics = lambda: {"val_loss": 9.0}  # stands in for the validation pass
    for loss in (1.0, 2.0, 3.0, 4.0):
        trainer._record(step.StepResult(loss=loss, num_tokens=8, grad_norm=1.0, lr=1e-3), 0.5)
    records = {r["step"]: r["data"] for r in sinks.read_log(tmp_path / sinks.LOG_NAME) if isinstance(r.get("step"), int)}
    assert records[2] == {"val_loss": 9.0}
    assert records[4]["loss"] == pytest.approx(2.5) and records[4]["step_time_s"] == pytest.approx(0.5)


def test_step_line_shows_the_time_left_at_the_windows_pace():
    import types

    from megatron_recipes.training.loop import Trainer

    said = []
    trainer = types.SimpleNamespace(step=20, cfg=types.SimpleNamespace(train=types.SimpleNamespace(train_iters=100)),
                                    _say=said.append)
    data = {"loss": 1.5, "step_time_s": 0.25, "mfu": "n/a", "peak_mem_gib": 0.5}
    Trainer._print(trainer, data)
    assert said[-1].endswith("| ETA 20 s") and said[-1].startswith("step     20/100")  # 80 steps x 0.25 s
    trainer.step = 100
    Trainer._print(trainer, data)
    assert "ETA" not in said[-1]  # the last step: nothing left
