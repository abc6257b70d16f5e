"""Stopping and restarting the real trainer changes nothing: exact resume, crash during a save, NaN, dead rank.

All runs: TP=2 over 2 CPU ranks, float32, the recipe's Adam (moments, warm-up and cosine decay all carry
state across the restart), the same small built-in corpus.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import train_support as ts

pytestmark = pytest.mark.slow

N = 3
BASE = [
    *ts.FAST,
    f"train.train_iters={2 * N}",
    "optimizer.lr_warmup_iters=2",
    "logging.eval_interval=2",
    "logging.eval_iters=1",
    "precision=fp32",
]
KILLER = Path(__file__).parent / "helpers" / "kill_during_save.py"



@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> ts.Run:
    """2N steps without interruption: the reference history."""
    return ts.train(tmp_path_factory.mktemp("straight") / "run", cache, *BASE, f"checkpoint.save_interval={N}", nproc=2).check()


def _history(run: ts.Run):
    return {key: run.series(key) for key in ("loss", "grad_norm", "lr", "val_loss")}


def test_stop_after_n_then_resume_is_bit_identical(tmp_path, cache, straight):
    run_dir = tmp_path / "run"
    first = ts.train(run_dir, cache, *BASE, f"checkpoint.save_interval={N}", f"train.exit_interval={N}", nproc=2).check()
    assert [r["step"] for r in first.records() if "loss" in r["data"]] == list(range(1, N + 1))
    assert (run_dir / "checkpoints" / f"iter_{N:07d}").is_dir() and "stopping at step 3" in first.output

    second = ts.train(run_dir, cache, *BASE, f"checkpoint.save_interval={N}", nproc=2).check()
    assert f"resumed from {run_dir / 'checkpoints' / f'iter_{N:07d}'}" in second.output
    resumed = _history(second)  # one log: steps 1..N from the first run, N+1..2N from the second
    assert resumed == _history(straight), f"resumed {resumed}\nstraight {_history(straight)}"
    assert len(resumed["loss"]) == 2 * N


def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous_complete_one(tmp_path, cache, straight):
    run_dir = tmp_path / "run"
    overrides = ["checkpoint.save_interval=2", "checkpoint.keep_last=3"]
    cmd = ts.command(run_dir, cache, [*BASE, *overrides], 2, "tiny_llama_cpu")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(KILLER)]
    env = {**ts._env(), "KILL_AT_STEP": "4", "KILL_RANK": "0"}
    crashed = subprocess.run(launcher + cmd[3:], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert crashed.returncode != 0, crashed.stdout + crashed.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "iter_0000002" / "meta.json").is_file()
    assert not (ckpts / "iter_0000004").exists(), "a save killed half-way must not look like a checkpoint"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    again = ts.train(run_dir, cache, *BASE, *overrides, nproc=2).check()
    assert f"resumed from {ckpts / 'iter_0000002'}" in again.output
    assert _history(again) == _history(straight)
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000004", "iter_0000006"]


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tmp_path, cache):
    run_dir = tmp_path / "run"
    exploding = [
        "optimizer=sgd",
        "optimizer.lr=1.0e30",
        "optimizer.min_lr=1.0e30",
        "optimizer.clip_grad=0.0",
        "optimizer.lr_warmup_iters=0",
        "optimizer.lr_decay_style=constant",
        "optimizer.use_distributed_optimizer=false",
        "checkpoint.save_interval=1",
    ]
    run = ts.train(run_dir, cache, *BASE, *exploding, nproc=2)
    assert run.returncode != 0
    assert "training diverged at step 2" in run.output, run.output[-3000:]
    # a checkpoint is called intact only after its files were checked against the save's record
    assert "is kept: " in run.output and "(its files verified as saved)" in run.output, run.output[-3000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000001"]
    diverged = [r for r in run.records() if r["data"].get("diverged")]
    assert [r["step"] for r in diverged] == [2]


def test_a_dying_rank_stops_the_whole_job(tmp_path, cache):
    run_dir = tmp_path / "run"
    proc = ts.start(run_dir, cache, *BASE, "train.train_iters=100000", "checkpoint.save=false", nproc=2)
    try:
        log = run_dir / "log.jsonl"
        deadline = time.monotonic() + 300
        while not (log.is_file() and ts.step_records(log)):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.5)
        # the CPU lane forks the ranks from the launcher's preloaded server (runtime/local_launch.py): its children,
        # with its command line
        server = [p for p in psutil.Process(proc.pid).children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        workers = [child for p in server for child in p.children()]
        assert len(server) == 1 and len(workers) == 2, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
        workers[1].send_signal(signal.SIGKILL)
        code = proc.wait(timeout=120)  # the job must end, not hang in a collective
        assert code != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_async_saves_finish_before_the_requeue_and_the_resume_is_exact(tmp_path, cache, straight):
    """checkpoint.async_save=true: a preemption's save runs in the background and is completed before the run
    marks itself preempted (the requeue's cue); the resumed run, saving in the background too, trains the
    same history as the uninterrupted synchronous one."""
    run_dir = tmp_path / "run"
    flag = tmp_path / "PREEMPT"
    flag.touch()  # a preemption notice already waiting: the first step's check stops the run
    first = ts.train(run_dir, cache, *BASE, "checkpoint.async_save=true", "checkpoint.save_interval=1000", nproc=2,
                     env={"MEGATRON_RECIPES_PREEMPT_FILE": str(flag)}).check()
    order = ["checkpoint save started: step 1", "waiting for the checkpoint in flight (step 1) before the requeue",
             "checkpoint save finished", "preempted: checkpoint at step 1 written"]
    where = [first.output.find(text) for text in order]
    assert -1 not in where and where == sorted(where), (where, first.output[-4000:])
    root = run_dir / "checkpoints"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1" and (run_dir / "preempted.json").exists()

    second = ts.train(run_dir, cache, *BASE, "checkpoint.async_save=true", "checkpoint.save_interval=2", nproc=2).check()
    assert f"resumed from {root / 'iter_0000001'}" in second.output
    assert f"checkpoint save finished: {root / f'iter_{2 * N:07d}'}" in second.output
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(2 * N)
    assert _history(second) == _history(straight)
