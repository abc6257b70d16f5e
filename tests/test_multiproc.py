"""The multi-rank harness itself (``multiproc.run_ranks``): a failing, dying or hung rank fails the test
with what happened; each rank gets the caller's environment at the call, its own seeds, and the
entry points' process patches before megatron-core."""

from __future__ import annotations

import os
import time

import pytest

from multiproc import RankFailed, run_ranks

from megatron_recipes.runtime import patches

PROCESS_PATCHES = [p.name for p in patches.PATCHES if p.scope == "process"]  # what the entry points apply


def _raise_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank one broke on purpose")
    return "fine"


def _die():
    os._exit(3)


def _abort_natively():
    os.abort()  # as glibc does on a heap-corruption check


def _hang():
    time.sleep(600)


def _what_the_rank_sees():
    import sys

    import torch

    from megatron_recipes.runtime import patches

    return {
        "env": (os.environ.get("MULTIPROC_PROBE"), os.environ.get("MULTIPROC_EXTRA"), os.environ["RANK"],
                os.environ["WORLD_SIZE"]),
        "seed": torch.initial_seed(),
        "compile_deferred": getattr(torch.compile, "_megatron_recipes_deferred", False),
        "process_patches": patches.apply("process"),
        "dynamo_imported": "torch._dynamo" in sys.modules,
        "threads": torch.get_num_threads(),
    }


def test_a_raising_rank_fails_with_its_traceback():
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_on_rank_1, 2)
    assert "rank 1 failed" in str(info.value) and "ValueError: rank one broke on purpose" in str(info.value)


def test_a_natively_crashing_rank_fails_with_where_it_crashed():
    with pytest.raises(RankFailed) as info:
        run_ranks(_abort_natively, 1)
    message = str(info.value)
    assert "exited (codes [-6]) without a result" in message, message
    assert "rank 0 native crash" in message and "_abort_natively" in message, message


def test_a_dying_rank_fails_with_its_exit_code():
    with pytest.raises(RankFailed, match=r"rank\(s\) \[0\] exited \(codes \[3\]\) without a result"):
        run_ranks(_die, 1)


def test_a_hung_rank_fails_at_the_timeout():
    with pytest.raises(RankFailed, match=r"rank\(s\) \[0\] did not finish within 3s"):
        run_ranks(_hang, 1, timeout=3)


def test_ranks_see_the_callers_environment_own_seeds_and_process_patches(monkeypatch):
    monkeypatch.setenv("MULTIPROC_PROBE", "set-by-this-test")  # after the server started: ranks still see it
    run_ranks(_what_the_rank_sees, 1)
    monkeypatch.setenv("MULTIPROC_PROBE", "changed")
    a, b = run_ranks(_what_the_rank_sees, 2, env={"MULTIPROC_EXTRA": "x"})
    assert a["env"] == ("changed", "x", "0", "2") and b["env"] == ("changed", "x", "1", "2")
    assert a["seed"] != b["seed"]  # as two fresh interpreters: not the server's generator state, twice
    for rank in (a, b):
        assert rank["compile_deferred"] and rank["process_patches"] == PROCESS_PATCHES
        assert not rank["dynamo_imported"] and rank["threads"] == 1
