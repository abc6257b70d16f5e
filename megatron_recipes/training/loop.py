"""The training loop of one rank: recipe in, megatron-core trains, metrics and checkpoints out.

Order of work: validate (before any process group: training/preflight.py), process groups, data artefacts, model + DDP +
optimizer + schedule, resume (``checkpoint.start_of`` decides: latest complete checkpoint, or pretrained
weights loaded before wrapping), datasets, then steps.
Every rank runs the same code; only rank 0 writes the run directory's files other than checkpoints.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_recipes import checkpoint, files
from megatron_recipes.config import derived
from megatron_recipes.config.compose import to_yaml
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.models import capabilities, fusions
from megatron_recipes.estimate import cost
from megatron_recipes.report import run_facts, write_report_after_run
from megatron_recipes.peft.state import peft_active, prepare_for_training
from megatron_recipes.runtime import distributed, versions
from megatron_recipes.training import (
    metrics,
    optim,
    run_lock,
    sinks,
    step,
)
from megatron_recipes.training.metrics import Window
from megatron_recipes.training.preemption import PreemptionWatcher
from megatron_recipes.training.preflight import NothingToTrain, preflight, validate  # noqa: F401 (the entry's names)


class TrainingDiverged(RecipeError):
    """The loss (or gradient norm) became NaN/Inf; the run stops and keeps its last good checkpoint."""


CONFIGS = "configs"  # run_dir/configs/start_step_NNNNNNN.yaml: the recipe of each start


def write_config(cfg: RunConfig, run_dir: Path, start_step: int) -> None:
    """The resolved recipe, as ``config.yaml`` (the latest start's; atomic: a reader never sees half of it),
    and kept per start under ``configs/``: a resume may change the layout, the lr or the length, and the
    record must still say what each segment was trained with."""
    text = to_yaml(cfg)
    files.write_text(run_dir / CONFIGS / f"start_step_{start_step:07d}.yaml", text)
    files.write_text(run_dir / "config.yaml", text)


class Trainer:
    """State of one training run on this rank."""

    def __init__(self, cfg: RunConfig, runtime: distributed.Runtime) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.device = runtime.device
        self.is_logger = runtime.rank == 0
        self.run_dir = Path(cfg.run.dir).expanduser().resolve()
        self.entropy: Optional[float] = None
        self.step = 0
        self.last_saved = -1
        self.consumed_samples = 0
        self.sink: Optional[sinks.MetricsLog] = None
        self.preemption = PreemptionWatcher(self.run_dir).install()  # SIGUSR1/SIGTERM or a flag file
        # checkpoint.async_save: saves write in the background, one at a time, completed before the next
        # save, a requeue and the exit (checkpoint/_async.py)
        self.background = checkpoint.BackgroundSaves() if checkpoint.async_enabled(cfg.checkpoint.async_save) else None
        self.saves, self.save_blocked_s = 0, 0.0  # the seconds the loop spent in saves and in waiting for them

    # ----- set-up -------------------------------------------------------------------------------
    def prepare_data_artifacts(self):
        """Corpus/tokenizer (built once, under a file lock, by whichever rank comes first)."""
        from megatron_recipes.data.tokenizer import load_tokenizer

        if self.cfg.data.kind == "builtin":
            from megatron_recipes.data.builtin import ensure_builtin_data

            self.entropy = ensure_builtin_data(self.cfg).unigram_entropy_nats
        return load_tokenizer(self.cfg)

    def build(self) -> None:
        from megatron_recipes.models.builder import build_model_chunks

        from megatron_recipes.data.identity import data_identity

        self.tokenizer = self.prepare_data_artifacts()
        adapters_only = peft_active(self.cfg)
        self.start = checkpoint.start_of(self.cfg, adapters_only=adapters_only)
        # what every save records and a resume must match (tokenizer, PEFT and its base, data), checked
        # before any tensor is read
        self.identity = checkpoint.run_identity(
            self.cfg, self.tokenizer.unique_identifiers.get("tokenizer_sha"), data_identity(self.cfg), adapters_only
        )
        self.start.check_identity(self.identity)
        chunks = build_model_chunks(self.cfg)
        self.start.load_weights(chunks)  # pretrained, PEFT base or own seed: into the bare chunks, before wrapping
        self.peft = prepare_for_training(self.cfg, chunks)  # PEFT adapters (before DDP)
        self.model = optim.wrap_model(self.cfg, chunks)
        self.optimizer = optim.build_optimizer(self.cfg, self.model)
        if self.start.weights is not None:
            # Clearing TE's kept init before the build instead would crash it (TE's clear leaves the getter,
            # which then returns None). A resume restores the main params from the optimizer state afterwards.
            optim.reload_main_params(self.cfg, self.optimizer)
        self.scheduler = optim.build_scheduler(self.cfg, self.optimizer)
        optim.configure_schedule_hooks(self.cfg, self.model, self.optimizer)  # grad_scale_func is the optimizer's
        self.forward_step = step.make_forward_step(
            self.device, capabilities.use_transformer_engine(), mtp=derived.mtp_stage(self.cfg)
        )

    def resume(self) -> int:
        """Step to continue from: a checkpoint's (restoring everything), else 0 (maybe from pretrained)."""
        state = self.start.resume(self.model, self.optimizer, self.scheduler) or {}
        step_ = int(state.get("step", 0))
        self.consumed_samples = int(state.get("consumed_samples", step_ * self.cfg.train.global_batch_size))
        return step_

    def build_iterators(self) -> None:
        from megatron.core import parallel_state

        from megatron_recipes.data.datasets import build_datasets  # pretraining kinds and sft

        self.train_ds, self.valid_ds, _ = build_datasets(self.cfg, self.tokenizer)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.train_iters = self._iterators(self.train_ds, self.consumed_samples)

    def _iterators(self, dataset, consumed: int) -> list:
        """One iterator per model chunk (the interleaved schedule reads each chunk's own)."""
        from megatron_recipes.data.batches import micro_batches

        t = self.cfg.train
        return [
            micro_batches(dataset, t.micro_batch_size, self.dp_rank, self.dp_size, consumed, self.cfg.data.num_workers,
                          vocab_size=self.cfg.model.vocab_size)
            for _ in self.model
        ]

    # ----- the loop -----------------------------------------------------------------------------
    def fit(self) -> int:
        if self.cfg.train.train_iters == 0:
            return self.write_seed()
        self.setup()
        while self.step < self.cfg.train.train_iters:
            if self.advance():
                return 0
        self.save()
        self.wait_for_save("before exit")
        self._say_saves()
        self._finish()
        return 0

    def write_seed(self) -> int:
        """``train.train_iters=0``: the step-0 weights as a weights-only checkpoint, then stop.

        Every layout started from it with ``checkpoint.pretrained`` holds the same weights (each layout's own
        initialisation differs: pipeline stages build different layers), so layouts compare step for step.
        """
        from megatron_recipes.models.builder import build_model_chunks

        found = checkpoint.latest(self.cfg)
        if found is not None and checkpoint.step_of(found) != 0:  # the seed would become the run's latest
            raise RecipeError(
                f"run.dir={self.cfg.run.dir} already holds this run's checkpoints (latest {found.name}); a step-0 "
                "seed written there would be what its next start resumes",
                fix="write the seed into its own run dir (run.dir=<new folder> train.train_iters=0)",
            )
        # the rule train.seed_run: no PEFT and no checkpoint.pretrained here (this writes fresh weights)
        model = optim.wrap_model(self.cfg, build_model_chunks(self.cfg))
        path = self._save_checkpoint(0, 0, model, None, None)
        self._say(
            f"seed checkpoint (step-0 weights, {self.cfg.model.name}) written: {path}\n"
            f"  start any layout from it: megatron-recipes train {self.cfg.run.name} checkpoint.pretrained={path} "
            "run.dir=<another run dir> parallel.tp=... parallel.pp=..."
        )
        return 0

    def setup(self) -> None:
        """Everything before the first step: model, optimizer, resume, data, run-directory files."""
        self.build()
        self.step = self.resume()
        self.last_saved = self.step
        self.build_iterators()
        if self.is_logger:
            write_config(self.cfg, self.run_dir, self.step)
            self.sink = sinks.MetricsLog(self.run_dir, self.step, self.cfg)
            self._announce()
        self.preemption.clear_marker()
        self.window = Window()
        self._evaluate_start()

    def advance(self) -> bool:
        """One training step and whatever is due after it; True when the run must stop here (cleanly)."""
        cfg = self.cfg
        start = time.perf_counter()
        result = step.train_step(cfg, self.model, self.optimizer, self.scheduler, self.train_iters, self.forward_step, self.device)
        self._record(result, time.perf_counter() - start)
        if self.background is not None:
            began = time.perf_counter()
            self.background.poll()  # completes a finished background save (tracker, retention)
            self.save_blocked_s += time.perf_counter() - began
        if self._due(cfg.checkpoint.save_interval):
            self.save()
        if self.preemption.requested(self.step):
            self.save()
            self.wait_for_save("before the requeue")
            self._say_saves()
            self.preemption.mark_preempted(self.step)
            self._say(f"preempted: checkpoint at step {self.step} written, exiting for a requeue")
            return True
        if self._exit_now():
            self.save()
            self.wait_for_save("before exit")
            self._say_saves()
            self._say(f"train.exit_interval={cfg.train.exit_interval}: stopping at step {self.step} (checkpoint written)")
            return True
        return False

    def _exit_now(self) -> bool:
        every = self.cfg.train.exit_interval
        return bool(every) and self.step % every == 0 and self.step < self.cfg.train.train_iters

    def _due(self, interval: int) -> bool:
        return interval > 0 and (self.step % interval == 0 or self.step == self.cfg.train.train_iters)

    def _record(self, result: step.StepResult, seconds: float) -> None:
        """Count the step, then log/evaluate what is due; a new window starts only after a training log line."""
        self.window.add(result, seconds)
        self.step += 1
        self.consumed_samples += self.cfg.train.global_batch_size
        self._stop_if_diverged(result)
        if self._periodic(result, self.window):
            self.window = Window()

    def _periodic(self, result: step.StepResult, window: Window) -> bool:
        """Log every ``log_interval`` steps, evaluate every ``eval_interval``; True when ``window`` was logged
        (an evaluation alone must not reset the window the next training line averages over)."""
        cfg = self.cfg
        data: Dict[str, Any] = {}
        logged = self._due(cfg.logging.log_interval)
        if logged:
            data.update(self._train_metrics(result, window))
        if self._due(cfg.logging.eval_interval) and cfg.logging.eval_iters > 0 and self.valid_ds is not None:
            data.update(self.evaluate_metrics())
        if data and self.sink is not None:
            self.sink.log(self.step, data)
            self._print(data)
        return logged

    def _train_metrics(self, result: step.StepResult, window: Window) -> Dict[str, Any]:
        step_time = window.seconds / max(1, len(window.losses))
        mfu = cost.mfu(self.cfg, step_time)
        return {
            "loss": sum(window.losses) / len(window.losses),
            **window.mtp_metrics(),
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens_per_sec": cost.tokens_per_step(self.cfg) / step_time if step_time > 0 else 0.0,
            "step_time_s": step_time,
            "mfu": mfu if mfu is not None else "n/a",
            "peak_mem_gib": metrics.max_over_ranks(metrics.peak_memory_gib()),
            "tokens": result.num_tokens,
            "skipped_steps": window.skipped,
        }

    def evaluate_metrics(self) -> Dict[str, Any]:
        """``val_loss`` over the same first ``eval_iters`` global batches every time (a comparable curve), and for
        SFT data ``task_accuracy``: the share of validation answers greedy decoding reproduces exactly
        (step.answer_counts). Not with CP, whose ranks each hold part of an answer."""
        optim.finish_param_sync(self.model)  # deferred all-gathers (overlap_param_gather) first
        iterators = self._iterators(self.valid_ds, 0)
        loss, accuracy = step.evaluate_with_accuracy(
            self.cfg, self.model, iterators, self.forward_step, self.device, self.cfg.logging.eval_iters
        )
        out: Dict[str, Any] = {"val_loss": loss}
        if self.cfg.data.kind == "sft" and self.cfg.parallel.cp == 1 and accuracy is not None:
            out["task_accuracy"] = accuracy
        return out

    def _evaluate_start(self) -> None:
        """Fine-tuning from step 0: the validation loss and task accuracy before any update (the baseline)."""
        cfg = self.cfg
        if self.step != 0 or cfg.data.kind != "sft" or cfg.logging.eval_iters < 1 or self.valid_ds is None:
            return
        data = self.evaluate_metrics()
        if self.sink is not None:
            self.sink.log(0, data)
            self._print(data)

    def _stop_if_diverged(self, result: step.StepResult) -> None:
        bad = [
            name
            for name, value in (("loss", result.loss), ("grad_norm", result.grad_norm))
            if value is not None and not math.isfinite(value)
        ]
        if not bad or not self.cfg.train.exit_on_nan:
            return
        if self.sink is not None:
            self.sink.log(self.step, {"loss": result.loss, "grad_norm": result.grad_norm, "diverged": True})
        latest = checkpoint.latest(self.cfg)
        kept = "no checkpoint was written before it"
        if latest:  # said to be intact only once its files are checked against what was saved
            try:
                state = ("its files verified as saved" if checkpoint.verify_files(latest)
                         else "not verified: it was saved without a checksum record")
                kept = f"the last checkpoint, from before the divergence, is kept: {latest} ({state})"
            except RecipeError as exc:
                kept = f"the last checkpoint {latest} is damaged, resume from an earlier one: {exc.message}"
        raise TrainingDiverged(
            f"training diverged at step {self.step}: {' and '.join(bad)} = "
            f"{result.loss if 'loss' in bad else result.grad_norm} (not a finite number); {kept}",
            fix="lower optimizer.lr, raise optimizer.lr_warmup_fraction (or lr_warmup_iters), keep optimizer.clip_grad > 0, or use "
            "precision=bf16/fp32 instead of fp16; the next start resumes from the kept checkpoint",
        )

    def save(self) -> None:
        """A checkpoint of the current step (once per step, and only when checkpoint.save is on)."""
        if not self.cfg.checkpoint.save or self.last_saved == self.step:
            return
        self.last_saved = self.step
        began = time.perf_counter()
        optim.finish_param_sync(self.model)  # else other ranks' shards would be the previous step's
        self._save_checkpoint(self.step, self.consumed_samples, self.model, self.optimizer, self.scheduler)
        self.saves, self.save_blocked_s = self.saves + 1, self.save_blocked_s + time.perf_counter() - began

    def wait_for_save(self, why: str) -> None:
        """A background save in flight is completed (or its failure raised) before ``why``."""
        if self.background is not None:
            began = time.perf_counter()
            self.background.wait(why)
            self.save_blocked_s += time.perf_counter() - began

    def _say_saves(self) -> None:
        if self.saves:
            mode = "in the background" if self.background is not None else "in the foreground"
            self._say(f"checkpoint saves: {self.saves} written {mode}; the training loop was blocked "
                      f"{self.save_blocked_s:.2f} s by them ({self.save_blocked_s / self.saves:.2f} s per save)")

    def _save_checkpoint(self, step_: int, consumed_samples: int, model, optimizer, scheduler) -> Path:
        """``consumed_samples`` is the whole data-iterator state (the batch iterator is a pure function of it);
        no optimizer (the step-0 seed) makes a weights-only checkpoint (always in the foreground)."""
        state = {"step": step_, "consumed_samples": consumed_samples}
        root = checkpoint.checkpoints_root(self.cfg)
        background = self.background if optimizer is not None else None
        return checkpoint.save(root, step_, model, optimizer, scheduler, state, self.cfg, self.cfg.checkpoint.keep_last,
                               background=background, record=getattr(self, "identity", None))

    # ----- output -------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.is_logger:
            print(text, flush=True)

    def _announce(self) -> None:
        cfg, p = self.cfg, self.cfg.parallel
        n_params = sum(param.numel() for chunk in self.model for param in chunk.parameters())
        layout = f"TP={p.tp} PP={p.pp}{f' VPP={p.vpp}' if p.vpp else ''} CP={p.cp} EP={p.ep} DP={derived.data_parallel_size(cfg)}"
        meta = {
            "recipe": cfg.run.name,
            "layout": layout,
            "world_size": self.runtime.world_size,
            "backend": self.runtime.backend,
            "cpu_lane": self.runtime.cpu_lane,
            "params_on_rank0": n_params,
            "flops_per_step": cost.flops_per_step(cfg),
            "start_step": self.step,
            "versions": versions.stack(),
            "layer_spec": "transformer_engine" if capabilities.use_transformer_engine() else "local",
            "fusions": {k: v for k, v in vars(self.model[0].config).items() if k in fusions.FIELDS.values()},
            "unigram_entropy_nats": self.entropy,
            **({"peft": {"method": self.peft.method, "trainable": self.peft.trainable, "total": self.peft.total}}
               if getattr(self, "peft", None) is not None else {}),
            **run_facts(),  # host, Slurm job/restart, and versions extended (python, transformers, ...) for the report
        }
        self.sink.metadata("run", meta)
        lane = " (CPU lane: megatron-core on CPU over gloo)" if self.runtime.cpu_lane else ""
        from megatron_recipes.estimate.params import model_params
        from megatron_recipes.progress import parameters

        self._say(
            f"training {cfg.model.name}: {layout} on {self.runtime.world_size} rank(s){lane}; "
            f"{parameters(model_params(cfg).total)} in the model, {n_params:,} on rank 0; "
            f"steps {self.step} -> {cfg.train.train_iters}; run dir {self.run_dir}"
        )
        self._say(
            f"versions: {versions.describe(meta['versions'])}; layer spec: {meta['layer_spec']}; "
            f"{fusions.describe(meta['fusions'])}"
        )

    def _print(self, data: Dict[str, Any]) -> None:
        parts = [f"step {self.step:>6}/{self.cfg.train.train_iters}"]
        fmt = {"loss": "{:.4f}", **{k: "{:.4f}" for k in data if k.startswith("mtp_") and k.endswith("_loss")},
               "val_loss": "{:.4f}", "task_accuracy": "{:.1%}", "lr": "{:.3e}", "grad_norm": "{:.3f}", "tokens_per_sec": "{:,.0f}"}
        for key, spec in fmt.items():
            if isinstance(data.get(key), (int, float)):
                parts.append(f"{key} {spec.format(data[key])}")
        if "step_time_s" in data:
            parts.append(f"step {data['step_time_s'] * 1000:.0f} ms")
            mfu = data["mfu"]
            parts.append(f"MFU {mfu:.1%}" if isinstance(mfu, float) else "MFU n/a")
            parts.append(f"peak mem {data['peak_mem_gib']:.2f} GiB")
            left = self.cfg.train.train_iters - self.step
            if left > 0:  # at the latest window's pace (evaluations and saves not counted)
                from megatron_recipes.progress import duration

                parts.append(f"ETA {duration(left * data['step_time_s'])}")
        self._say(" | ".join(parts))

    def _finish(self) -> None:
        if not self.is_logger:
            return
        if self.cfg.logging.plot:
            sinks.plot_losses(
                self.run_dir / sinks.LOG_NAME, self.run_dir / sinks.PLOT_NAME, title=self.cfg.run.name, baseline=self.entropy
            )
        # report.html (a failure warns, never fails the run); its layout picture only where plots are wanted
        report = write_report_after_run(self.run_dir, picture=self.cfg.logging.plot)
        self.sink.close(self.run_dir / sinks.PLOT_NAME, report, finished=True)
        records = sinks.step_records(self.run_dir / sinks.LOG_NAME)
        losses = [r["data"]["loss"] for r in records if isinstance(r["data"].get("loss"), (int, float))]
        vals = [r["data"]["val_loss"] for r in records if isinstance(r["data"].get("val_loss"), (int, float))]
        accs = [r["data"]["task_accuracy"] for r in records if isinstance(r["data"].get("task_accuracy"), (int, float))]
        lines = [f"done: {self.step} steps; run dir {self.run_dir}"]
        if losses:
            lines.append(f"  train loss: first logged {losses[0]:.4f} -> last logged {losses[-1]:.4f} nats/token")
        if vals:
            lines.append(f"  validation loss: {vals[-1]:.4f} nats/token")
        if accs:
            lines.append(f"  task accuracy (validation answers reproduced exactly): {accs[0]:.1%} -> {accs[-1]:.1%}")
        if self.entropy is not None:
            lines.append(f"  unigram entropy of the corpus: {self.entropy:.4f} nats/token (a model ignoring context)")
        latest = checkpoint.latest(self.cfg)
        if latest:
            lines.append(f"  checkpoint: {latest}")
        if (self.run_dir / sinks.PLOT_NAME).is_file():
            lines.append(f"  loss curve: {self.run_dir / sinks.PLOT_NAME}")
        if report:
            lines.append(f"  report: {report}")
        self._say("\n".join(lines))

    def close(self) -> None:
        if self.background is not None:
            self.background.abort()  # after an error only: a normal end has completed its saves already
        if self.sink is not None:
            self.sink.close()
        self.preemption.uninstall()


def run(cfg: RunConfig, recipe: str = "recipe", validated: bool = False) -> int:
    """Train ``cfg`` on this rank (called once per rank, under torchrun or as a single process);
    ``validated``: the caller has just run ``validate`` on this ``cfg`` in this process."""
    if not validated:
        try:
            validate(cfg, recipe)
        except NothingToTrain as done:
            if os.environ.get("RANK", "0") == "0":  # one line per job, not per rank
                print(done, flush=True)
            return 0
    runtime = distributed.init_model_parallel(cfg)
    lock = run_lock.RunLock(Path(cfg.run.dir))  # global rank 0 holds it; every rank stops if it is taken
    try:
        took_over = checkpoint.on_rank0("locking run.dir", lambda: lock.acquire().took_over)
        if took_over and runtime.rank == 0:
            print(f"run.dir: {took_over}", flush=True)
        # Saves that never finished (killed, disk full) are this run's own leftovers: the lock says no
        # other run is writing here.
        checkpoint.on_rank0("cleaning unfinished saves",
                            lambda: checkpoint.clean_leftovers(checkpoint.checkpoints_root(cfg)))
        trainer = Trainer(cfg, runtime)
        try:
            return trainer.fit()
        finally:
            trainer.close()
    finally:
        lock.release()
        distributed.shutdown()
