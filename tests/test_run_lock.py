"""One run per run.dir: a second run is refused naming the holder; stale locks (this host's dead process,
or this very Slurm job requeued) are taken over; the lock goes away with the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.training.run_lock import LOCK_NAME, RunLock
from multiproc import run_ranks

HOST = socket.gethostname()


def _holder(run_dir: Path, **fields) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": HOST, "pid": os.getpid(), "slurm_job_id": None, "started": "2026-01-01T00:00:00+00:00", **fields}
    (run_dir / LOCK_NAME).write_text(json.dumps(record))
    return run_dir / LOCK_NAME


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_live_holder_is_named_and_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _holder(tmp_path, slurm_job_id="77")
    with pytest.raises(RecipeError) as info:
        RunLock(tmp_path).acquire()
    text = str(info.value)
    assert f"host {HOST}, pid {os.getpid()}, Slurm job 77, started 2026-01-01T00:00:00+00:00" in text
    assert str(tmp_path / LOCK_NAME) in text  # the way out, once that run is known to be gone


def test_holder_on_another_host_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    _holder(tmp_path, host="some-other-node", pid=1, slurm_job_id="99")
    with pytest.raises(RecipeError, match="some-other-node"):
        RunLock(tmp_path).acquire()


def test_stale_locks_are_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _holder(tmp_path / "a", pid=_dead_pid())
    lock = RunLock(tmp_path / "a").acquire()
    assert "no longer exists" in lock.took_over
    assert json.loads((tmp_path / "a" / LOCK_NAME).read_text())["pid"] == os.getpid()

    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # requeued: the same job id, a live-looking pid elsewhere
    _holder(tmp_path / "b", host="earlier-node", pid=1, slurm_job_id="4242")
    assert "was requeued" in RunLock(tmp_path / "b").acquire().took_over


def test_release_removes_only_our_lock(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    lock = RunLock(tmp_path).acquire()
    assert lock.took_over is None and (tmp_path / LOCK_NAME).exists()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()


def _train_into_locked_dir(run_dir: str):
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.training import loop

    cfg = compose_recipe("tiny_llama_cpu", [f"run.dir={run_dir}", "train.train_iters=2", "optimizer.lr_warmup_iters=0"])
    try:
        loop.run(cfg, "tiny_llama_cpu")
    except RecipeError as exc:
        return str(exc)
    return "trained"


@pytest.mark.slow
def test_second_run_in_the_same_dir_stops_before_touching_it(tmp_path):
    """The issue's probe: a second run with the first one's run.dir (here: a live holder on this host)."""
    lock = _holder(tmp_path / "run")
    before = lock.read_text()
    outcomes = run_ranks(_train_into_locked_dir, 2, str(tmp_path / "run"), env={"SLURM_JOB_ID": ""})
    assert all("is in use by another run" in o and f"pid {os.getpid()}" in o for o in outcomes), outcomes
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_NAME]  # no config.yaml, log, checkpoints
    assert lock.read_text() == before
