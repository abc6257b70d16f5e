"""PreemptionWatcher: real signals to this process, the flag file, the marker, and the cross-rank agreement."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from multiproc import run_ranks

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.run_files import read_marker
from megatron_recipes.training.preemption import FLAG_FILE_ENV, PreemptionWatcher


@pytest.fixture()
def watcher(tmp_path, monkeypatch):
    monkeypatch.delenv(FLAG_FILE_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    w = PreemptionWatcher(tmp_path).install()
    yield w
    w.uninstall()


def test_no_request_by_default(watcher):
    assert [watcher.requested(s) for s in range(5)] == [False] * 5


def test_real_signal_sets_request_and_does_not_kill(watcher):
    assert not watcher.requested(1)
    os.kill(os.getpid(), signal.SIGUSR1)  # delivered to this (main) thread before kill() returns
    assert watcher.requested(2)
    assert watcher.reason == "signal SIGUSR1"


def test_sigterm_is_caught_too(watcher):
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.requested(0)
    assert watcher.reason == "signal SIGTERM"


def test_uninstall_restores_previous_handler(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda *_: seen.append(1))
    try:
        w = PreemptionWatcher(tmp_path, signals=("USR2",)).install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert w.requested(0) and not seen
        w.uninstall()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [1]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_flag_file_requests_stop_and_mark_consumes_it(watcher, tmp_path):
    flag = tmp_path / "PREEMPT"
    assert not watcher.requested(3)
    flag.touch()
    assert watcher.requested(4)
    assert str(flag) in watcher.reason
    watcher.mark_preempted(4)
    marker = json.loads((tmp_path / "preempted.json").read_text())
    assert marker["step"] == 4 and str(flag) in marker["reason"]
    assert "time" in marker
    assert not flag.exists()
    assert read_marker(tmp_path)["step"] == 4
    # no temporary files left next to the marker
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preempted.json"]


def test_check_every_skips_steps(tmp_path, monkeypatch):
    monkeypatch.delenv(FLAG_FILE_ENV, raising=False)
    (tmp_path / "PREEMPT").touch()
    w = PreemptionWatcher(tmp_path, check_every=5)
    assert [w.requested(s) for s in range(1, 6)] == [False, False, False, False, True]


def test_flag_path_from_environment(tmp_path, monkeypatch):
    other = tmp_path / "elsewhere" / "STOP"
    monkeypatch.setenv(FLAG_FILE_ENV, str(other))
    w = PreemptionWatcher(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "PREEMPT").touch()  # the default path no longer counts
    assert not w.requested(0)
    other.parent.mkdir()
    other.touch()
    assert w.requested(1)


def test_clear_marker_keeps_a_pending_flag(watcher, tmp_path):
    (tmp_path / "preempted.json").write_text("{}")
    (tmp_path / "PREEMPT").touch()
    watcher.clear_marker()
    assert not (tmp_path / "preempted.json").exists()
    assert (tmp_path / "PREEMPT").exists()
    assert read_marker(tmp_path) is None


def test_only_rank0_writes_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    w = PreemptionWatcher(tmp_path)
    w.mark_preempted(7)
    assert not (tmp_path / "preempted.json").exists()


def test_bad_signal_name_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="USR3"):
        PreemptionWatcher(tmp_path, signals=("USR3",))


# --- two real processes over gloo: one rank is told, both stop at the same step -----------------

def _agreement_worker(run_dir: str, how: str, out_dir: str) -> None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if how == "file":
        # each rank looks at its own flag path, as with node-local storage: only rank 1's appears
        os.environ[FLAG_FILE_ENV] = str(Path(run_dir) / f"flag-rank{rank}")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    w = PreemptionWatcher(run_dir).install()
    stopped = None
    for step in range(1, 20):
        if rank == 1 and step == 6:
            if how == "signal":
                os.kill(os.getpid(), signal.SIGUSR1)
            else:
                Path(os.environ[FLAG_FILE_ENV]).touch()
        if w.requested(step):
            stopped = step
            w.mark_preempted(step)
            break
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"stopped": stopped, "reason": w.reason}))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["signal", "file"])
def test_two_ranks_agree_on_the_stop_step(tmp_path, how):
    run_dir, out_dir = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out_dir.mkdir()
    run_ranks(_agreement_worker, 2, str(run_dir), how, str(out_dir))
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["stopped"] for r in results] == [6, 6]
    # rank 0 never saw the signal or its own flag: it stopped because rank 1 did
    assert results[0]["reason"] == "requested by another rank"
    assert results[1]["reason"] == ("signal SIGUSR1" if how == "signal" else f"flag file {run_dir / 'flag-rank1'}")
    marker = read_marker(run_dir)
    assert marker is not None and marker["step"] == 6
