"""The CPU lane's patch points, one by one, in fresh processes (it patches process-wide state).

The parallel-equivalence tests prove the lane end to end; these name the exact patch that broke.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from multiproc import run_ranks


def _patched_entry_points():
    import torch

    from megatron_recipes.runtime import cpu_lane

    cpu_lane.activate()
    from megatron.core.tensor_parallel import random as mrandom

    out = {
        "factory_device": str(torch.empty(2, device="cuda").device),
        "int_device": str(torch.zeros(2, device=0).device),
        "dot_cuda": str(torch.ones(2).cuda().device),
        "to_cuda": str(torch.ones(2).to("cuda:0").device),
        "type_string": torch.ones(2).type(),
        "bf16_type_string": torch.ones(2, dtype=torch.bfloat16).type(),
        "type_convert": torch.ones(2).type(torch.float64).dtype == torch.float64,
        "current_device": torch.cuda.current_device(),
    }
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().synchronize()
    # The tracker's named stream is a different state from the default one, and a fork restores the default.
    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    before = torch.get_rng_state()
    with mrandom.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    out["fork_restores_default"] = bool(torch.equal(before, torch.get_rng_state()))
    unforked = torch.rand(4)
    out["fork_is_another_stream"] = not torch.equal(forked, unforked)
    with mrandom.get_cuda_rng_tracker().fork():
        out["fork_stream_advances"] = not torch.equal(torch.rand(4), forked)
    return out


def test_device_rng_stream_and_type_patches():
    out = run_ranks(_patched_entry_points, 1)[0]
    assert out["factory_device"] == out["int_device"] == out["dot_cuda"] == out["to_cuda"] == "cpu"
    assert out["type_string"] == "torch.cuda.FloatTensor"
    assert out["bf16_type_string"] == "torch.cuda.BFloat16Tensor"
    assert out["type_convert"] and out["current_device"] == 0
    assert out["fork_restores_default"] and out["fork_is_another_stream"] and out["fork_stream_advances"]


def _backward_runs_in_the_lane():
    import torch
    from megatron.core.tensor_parallel.random import checkpoint

    from megatron_recipes.runtime import cpu_lane

    cpu_lane.activate()

    class DeviceInBackward(torch.autograd.Function):  # as megatron-core's MoE dispatchers' backward
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad + torch.zeros(grad.shape, device=torch.cuda.current_device())

    def block(x):  # recomputed in backward; literal CUDA devices as in megatron-core's layers
        return DeviceInBackward.apply(x) * torch.ones(x.shape, device="cuda")

    out = {}
    for entry in ("tensor.backward", "autograd.backward", "autograd.grad"):
        x = torch.ones(3, requires_grad=True)
        # megatron-core's full activation recompute (which .grad() cannot take)
        y = (block(x) if entry == "autograd.grad" else checkpoint(block, False, x)).sum()
        try:
            if entry == "tensor.backward":
                y.backward()
            elif entry == "autograd.backward":
                torch.autograd.backward(y)
            else:
                x.grad = torch.autograd.grad(y, x)[0]
            out[entry] = x.grad.tolist()
        except RuntimeError as exc:
            out[entry] = str(exc)
    return out


def test_backward_and_recompute_run_with_cpu_devices():
    """A backward entry reaches the lane's mode handler, which runs with the mode popped: the whole backward
    pass (recompute, custom Functions) must still see CUDA devices mapped to CPU."""
    out = run_ranks(_backward_runs_in_the_lane, 1)[0]
    assert out == {entry: [2.0, 2.0, 2.0] for entry in ("tensor.backward", "autograd.backward", "autograd.grad")}, out


def _one_rank_group(stale_port: bool):
    import os
    import socket

    import torch.distributed as dist

    from megatron_recipes.runtime.distributed import init_process_group

    listener = socket.socket()  # a port this process listens on, as a leaked one-rank store does
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    if stale_port:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listener.getsockname()[1]))
    before = os.environ.get("MASTER_PORT")
    rt = init_process_group(timeout_minutes=1)
    return rt.world_size, dist.get_world_size(), before == os.environ.get("MASTER_PORT")


@pytest.mark.parametrize("stale_port", [False, True], ids=["clean-env", "port-in-use-in-env"])
def test_a_one_rank_group_neither_reads_nor_leaves_a_rendezvous_port(stale_port):
    """Conversion, data tools and tests open one-rank groups in their own process. That group used to take
    MASTER_PORT from the environment (a port left by a shell or a parent: EADDRINUSE) and to write its own
    there (inherited by every subprocess started after, while this process still listened on it)."""
    assert run_ranks(_one_rank_group, 1, stale_port)[0] == (1, 1, True)


def _all_to_all_with_tensor_splits():
    import torch
    import torch.distributed as dist

    from megatron_recipes.runtime.distributed import init_process_group

    rt = init_process_group()
    # rank r sends r+1 rows to each peer, as megatron-core's MoE dispatcher does with tensor split sizes
    rows = rt.rank + 1
    send = torch.full((rows * 2, 3), float(rt.rank))
    in_splits = torch.tensor([rows, rows])
    out_splits = torch.tensor([1, 2])
    recv = torch.empty(int(out_splits.sum()), 3)
    dist.all_to_all_single(recv, send, out_splits, in_splits)
    return recv[:, 0].tolist()


def test_all_to_all_accepts_tensor_split_sizes_on_gloo():
    got = run_ranks(_all_to_all_with_tensor_splits, 2)
    assert got[0] == [0.0, 1.0, 1.0] and got[1] == [0.0, 1.0, 1.0]


def _gloo_worker_threads():
    import torch
    import torch.distributed as dist

    from megatron_recipes.runtime.distributed import init_process_group

    init_process_group()
    group = dist.new_group([0, 1])
    out = {}
    for name, pg in (("default", dist.group.WORLD), ("new", group)):
        backend = pg._get_backend(torch.device("cpu"))
        out[name] = backend.options._threads
        works = [dist.all_reduce(torch.ones(3) * (i + 1), group=pg, async_op=True) for i in range(4)]
        for work in works:
            work.wait()
    return out


def test_every_gloo_group_runs_its_collectives_on_one_worker_thread():
    """Two gloo worker threads per group running async collectives side by side corrupted the heap in
    torch 2.13 (runtime/cpu_lane.py ``_one_gloo_worker_thread``): the lane's groups have one."""
    assert run_ranks(_gloo_worker_threads, 2) == [{"default": 1, "new": 1}] * 2


def _refuses_with_cuda():
    import torch

    from megatron_recipes.runtime import cpu_lane

    torch.cuda.is_available = lambda: True
    try:
        cpu_lane.activate()
    except RuntimeError as exc:
        return str(exc)
    return "activated"


def test_refuses_to_activate_when_cuda_is_present():
    message = run_ranks(_refuses_with_cuda, 1)[0]
    assert "must not run on a machine with CUDA" in message


def test_announces_itself_once_and_compile_stays_lazy():
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING);"
        "import megatron_recipes.runtime.patches as patches; patches.apply('process');"  # what the entry points do
        "import megatron_recipes.runtime.cpu_lane as lane; lane.activate();"
        "import megatron.core.models.gpt;"
        "print('dynamo imported' if 'torch._dynamo' in sys.modules else 'dynamo not imported')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("CPU lane active") == 1
    assert "dynamo not imported" in res.stdout
