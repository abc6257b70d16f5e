"""A failed local job says its error once: the failing rank's message, not one per rank and not torch
elastic's failure lines, from both ways the local launcher starts ranks (runtime/local_launch.py): forked
from the preloaded server (the CPU lane) and torchrun's fresh interpreters (with CUDA)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

TARGET = textwrap.dedent("""
    import os, pathlib, sys, time
    from megatron_recipes.runtime.rank_errors import ENV, report

    rank, failing = int(os.environ["RANK"]), [int(r) for r in sys.argv[1].split(",")]
    if rank in failing and sys.argv[2:] == ["--silent"]:
        os._exit(3)  # a native death: no message
    if rank in failing:
        report(sys.argv[2] if len(sys.argv) > 2 else f"the file of rank {rank} is unreadable\\n  fix: check it")
        # the first rank to exit gets the others stopped: leave once every failing rank has said its error (on a
        # busy machine a rank still starting would otherwise be stopped before it fails)
        deadline = time.monotonic() + 30
        while len(list(pathlib.Path(os.environ[ENV]).glob("rank*.txt"))) < len(failing) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(2)
    time.sleep(60)  # a healthy rank waits in a collective until the launcher stops it
""")


LAUNCHERS = ["forked_ranks", "torchrun_ranks"]


def _job(tmp_path, launcher: str, *args: str):
    script = tmp_path / "rank.py"
    script.write_text(TARGET)
    code = (f"import sys; from megatron_recipes.runtime.local_launch import {launcher}; "
            f"sys.exit({launcher}({list(args)!r}, 3, ({str(script)!r},)))")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_same_error_on_every_rank_is_said_once(tmp_path, launcher):
    done, _ = _job(tmp_path, launcher, "0,1,2", "data file x.jsonl line 3 is not JSON\n  fix: fix that line")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: data file x.jsonl line 3 is not JSON", "  fix: fix that line",
                     "  (ranks 0, 1, 2 all failed with this)"], done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_one_failing_rank_is_named_and_the_others_are_stopped_quietly(tmp_path, launcher):
    done, seconds = _job(tmp_path, launcher, "1")
    assert done.returncode == 2 and seconds < 50  # the sleeping ranks were stopped, not waited for
    assert done.stderr.strip().splitlines() == ["error: the file of rank 1 is unreadable", "  fix: check it", "  (rank 1)"]
    assert "exitcode" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_that_dies_without_a_message_is_named_with_its_code(tmp_path, capsys, launcher):
    from megatron_recipes.runtime.local_launch import _said

    done, _ = _job(tmp_path, launcher, "1", "--silent")
    assert done.returncode == 3
    assert done.stderr.strip().splitlines()[-1] == "error: rank 1 failed (exit code 3); the other ranks were stopped"
    _said(tmp_path, {2: -9, 0: 1})  # ranks seen ended together (one died, its peer's collective then failed)
    assert capsys.readouterr().err == "error: rank 0 failed (exit code 1); rank 2 failed (exit code -9); the other ranks were stopped\n"


def test_a_rank_outside_the_local_launcher_says_its_error_itself(monkeypatch, capsys):
    from megatron_recipes.runtime import rank_errors

    monkeypatch.delenv(rank_errors.ENV, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    rank_errors.report("bad\n  fix: good")
    assert capsys.readouterr().err == "[rank 3] error: bad\n  fix: good\n"


def test_summary_tells_different_errors_apart(tmp_path):
    from megatron_recipes.runtime.rank_errors import summary

    assert summary(tmp_path) is None
    (tmp_path / "rank000002.txt").write_text("b broke")
    (tmp_path / "rank000000.txt").write_text("a broke")
    (tmp_path / "rank000001.txt").write_text("a broke")
    assert summary(tmp_path) == "error: a broke\n  (ranks 0, 1 all failed with this)\n  other ranks failed differently: rank 2: b broke"


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-torchrun", "cpu-lane-forked"])
def test_the_local_launcher_forks_ranks_only_without_cuda(monkeypatch, cuda):
    """A server that imported Transformer Engine may have initialised CUDA, which a forked rank cannot use: on a
    machine with CUDA the ranks must start through torchrun (the CPU lane cannot run that machine's path)."""
    import torch

    from megatron_recipes.runtime import local_launch

    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(local_launch, "torchrun_ranks", lambda *a: started.append(("torchrun", a)) or 0)
    monkeypatch.setattr(local_launch, "forked_ranks", lambda *a: started.append(("forked", a)) or 0)
    assert local_launch.spawn_local(["r"], 2, ("--module", "m"), tokenizers=True, compiles=True) == 0
    assert started == ([("torchrun", (["r"], 2, ("--module", "m")))] if cuda
                       else [("forked", (["r"], 2, ("--module", "m"), True, True))])
