"""Rewinding a run and writing a seed into it, with the real one-rank trainer (issue 30, cases 2 and 5).

A rewind (``checkpoint.load=R/checkpoints/iter_0000004`` in a run that also holds iter_0000006) continues the
run from there: retention keeps the rewind point, and the next plain start (a requeue) resumes the new branch,
never the abandoned later checkpoint. A step-0 seed is never written over a run's own checkpoints.
"""

from __future__ import annotations

import pytest

import train_support as ts
from megatron_recipes import checkpoint

pytestmark = pytest.mark.slow

BASE = [*ts.FAST, "parallel.tp=1", "precision=fp32", "checkpoint.keep_last=2"]


def _steps(root):
    return sorted(checkpoint.step_of(p) for p in root.iterdir() if checkpoint.step_of(p) is not None and checkpoint.is_complete(p))


def test_a_rewind_keeps_its_start_and_a_requeue_resumes_the_new_branch(tmp_path, cache):
    # Before: retention (by step order) deleted iter_4, the rewind point, kept the abandoned iter_6, and the
    # next plain start resumed from iter_6 because `latest` ignored the tracker.
    run = tmp_path / "run"
    root = run / "checkpoints"
    ts.train(run, cache, *BASE, "train.train_iters=6", "checkpoint.save_interval=2").check()
    assert _steps(root) == [4, 6]
    rewound = ts.train(run, cache, *BASE, "train.train_iters=5", "checkpoint.save_interval=1",
                       f"checkpoint.load={checkpoint.iter_dir(root, 4)}").check()
    assert _steps(root) == [4, 5, 6]  # the rewind point stays; the abandoned iter_6 is not deleted either
    assert checkpoint.latest(root) == checkpoint.iter_dir(root, 5)
    assert "rewound to" in rewound.output, rewound.output[-3000:]
    # the requeue of the finished branch finds its end (iter_5), not the abandoned iter_6, and trains nothing
    requeued = ts.train(run, cache, *BASE, "train.train_iters=5", "checkpoint.save_interval=1").check()
    assert f"nothing to train: {checkpoint.iter_dir(root, 5)} is at step 5" in requeued.output, requeued.output[-3000:]
    assert _steps(root) == [4, 5, 6]
    ts.train(run, cache, *BASE, "train.train_iters=7", "checkpoint.save_interval=1").check()
    assert _steps(root) == [6, 7]  # past the abandoned step (its iter_6 replaced): retention as usual again


def test_a_seed_run_never_writes_over_a_runs_own_checkpoints(tmp_path, cache):
    # Before: the seed's own save deleted it (keep_last=2 kept the later iter_2, iter_4) and the run still
    # printed "seed checkpoint written" with the command to use it.
    run = tmp_path / "run"
    root = run / "checkpoints"
    ts.train(run, cache, *BASE, "train.train_iters=4", "checkpoint.save_interval=2").check()
    before = _steps(root)
    seed = ts.train(run, cache, *BASE, "train.train_iters=0")
    assert seed.returncode == 2 and "already holds this run's checkpoints" in seed.output, seed.output[-3000:]
    assert "seed checkpoint" not in seed.output and "fix: write the seed into its own run dir" in seed.output
    assert _steps(root) == before == [2, 4]
    fresh = ts.train(tmp_path / "seed", cache, *BASE, "train.train_iters=0").check()  # its own run dir: written
    assert "seed checkpoint" in fresh.output and checkpoint.is_complete(checkpoint.iter_dir(tmp_path / "seed" / "checkpoints", 0))
