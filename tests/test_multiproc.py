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

    preloaded = "megatron.core.models.gpt" in sys.modules and "megatron_recipes.training.loop" in sys.modules
    import torch

    from megatron_recipes.runtime import patches

    return {
        "env": (os.environ.get("MULTIPROC_PROBE"), os.environ.get("MULTIPROC_EXTRA"), os.environ["RANK"],
                os.environ["WORLD_SIZE"]),
        "seed": torch.initial_seed(),
        "compile_deferred": getattr(torch.compile, "_megatron_recipes_deferred", False),
        "process_patches": patches.apply("process"),
        "preloaded": preloaded,
        "threads": torch.get_num_threads(),
    }


def _leave_traces():
    """Everything a rank could leave behind for the next one, were ranks reused or run in one process."""
    import torch
    from megatron.core import parallel_state

    from megatron_recipes.runtime import distributed

    distributed.init_process_group()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    os.environ["MULTIPROC_TRACE"] = "left"
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    parallel_state._MULTIPROC_TRACE = "left"
    return _traces()


def _traces():
    import sys

    import torch
    import torch.distributed as dist

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    return {
        "process_group": dist.is_initialized(),
        "model_parallel": bool(parallel_state and parallel_state.model_parallel_is_initialized()),
        "env": os.environ.get("MULTIPROC_TRACE"),
        "dtype": str(torch.get_default_dtype()),
        "seed": torch.initial_seed(),
        "module_state": getattr(parallel_state, "_MULTIPROC_TRACE", None),
        "cpu_lane": bool(getattr(sys.modules.get("megatron_recipes.runtime.cpu_lane"), "_ACTIVE", False)),
    }


def test_no_state_leaks_from_one_rank_to_the_next():
    """Ranks that ran megatron-core's process groups, changed the environment, torch's defaults and a module
    leave nothing to the ranks of the next call: each starts from the server's clean state."""
    left = run_ranks(_leave_traces, 2)
    assert all(t["model_parallel"] and t["env"] == "left" and t["dtype"] == "torch.float64" and t["seed"] == 1234
               and t["module_state"] == "left" and t["cpu_lane"] for t in left), left  # the traces were really left
    after = run_ranks(_traces, 2)
    for t in after:
        assert not t["process_group"] and not t["model_parallel"], t
        assert t["env"] is None and t["dtype"] == "torch.float32" and t["module_state"] is None, t
        assert t["seed"] != 1234 and not t["cpu_lane"], t


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
        assert rank["preloaded"] and rank["threads"] == 1  # forked from check's server, not a fresh import
