"""The CPU lane: run unmodified megatron-core on CPU processes over gloo.

megatron-core assumes CUDA everywhere (``torch.cuda.current_device()``, literal ``device="cuda"``, the
CUDA RNG tracker, streams, ``torch.cuda.*Tensor`` type strings). This module patches exactly those
process-wide entry points so the same model, schedules, DDP, distributed optimizer and
dist-checkpointing code paths run on CPU. It exists so CI can prove parallel layouts correct and users
can debug a recipe's layout on a laptop.

It is only ever activated when CUDA is absent (``activate()`` refuses otherwise) and it announces itself
in the log. Apply it once, at start-up, before building any model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_recipes.runtime import patches

log = logging.getLogger(__name__)

_ACTIVE = False
_MODE: TorchFunctionMode | None = None
_CUDA_DEVICE = re.compile(r"^cuda(:\d+)?$")
_CPU = torch.device("cpu")


def needed() -> bool:
    """The lane is for machines without CUDA only."""
    return not torch.cuda.is_available()


def _as_cpu(device: Any) -> Any:
    """Map any CUDA device spelling (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int) to CPU."""
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return _CPU if _CUDA_DEVICE.match(device) else device
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU  # an int device index means a CUDA device to torch
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU (factories, ``.to``, ``.cuda``), unpins."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _as_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):  # pinned memory needs an accelerator (e.g. the CP rotary-embedding split)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _as_cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


def cuda_calls_on_cpu() -> TorchFunctionMode:
    """The device rewrite alone, for a ``with`` block (probing a CUDA-only function without the lane)."""
    return _CudaToCpuMode()


class _NoOpStream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is synchronous.

    gloo collectives are not: they run on a background thread until ``Work.wait()``. On a GPU, streams and the
    caching allocator keep collective buffers alive; here that holds only because megatron-core (DDP,
    Megatron-FSDP) waits for each Work before freeing or using its tensors (tests/test_fsdp_inflight.py).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> "_NoOpEvent":
        return _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NoOpStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _NoOpEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_STREAM = _NoOpStream()


class _NoOpNvtx:
    """Stand-in for ``torch.cuda.nvtx`` (profiler ranges), which a CPU build of torch refuses: megatron-core's
    EP-overlap schedule nodes mark every step with it (pipeline_parallel/utils.py)."""

    @staticmethod
    def range_push(msg: str) -> int:
        return 0

    @staticmethod
    def range_pop() -> int:
        return 0

    @staticmethod
    def mark(msg: str) -> None:
        return None

    @staticmethod
    def range(msg: str, *args: Any, **kwargs: Any):
        return contextlib.nullcontext()


def _patch_record_stream() -> None:
    """``Tensor.record_stream`` keeps a CUDA tensor's memory from being reused before another stream is done
    with it; CPU tensors have no streams (and torch refuses the call). megatron-core's EP-overlap schedule
    nodes call it on every input they free and every gradient they pass on (pipeline_parallel/utils.py,
    models/gpt/fine_grained_callables.py); on the lane, where work is synchronous, it is a no-op."""
    original = torch.Tensor.record_stream
    if getattr(original, "_lane", False):
        return

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return None
        return original(self, stream)

    record_stream._lane = True
    torch.Tensor.record_stream = record_stream


def _patch_cuda_namespace() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpEvent
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _STREAM
    cuda.default_stream = lambda *a, **k: _STREAM
    cuda.nvtx = _NoOpNvtx
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    # The CUDA RNG becomes the CPU default generator, so megatron-core's RNG tracker forks real state.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls this after seeding the CPU generator
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _patch_tensor_type() -> None:
    """The optimizers accept only ``torch.cuda.*Tensor`` type strings; report CPU floats as such."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs) if dtype is not None else original(self)

    torch.Tensor.type = type_


def _patch_all_to_all() -> None:
    """gloo's binding wants split sizes as Python lists; megatron-core's MoE dispatcher passes tensors."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = all_to_all_single
    c10d.all_to_all_single = all_to_all_single


def _one_gloo_worker_thread() -> None:
    """Every gloo process group made from now on runs its collectives on one worker thread (torch's
    default is two per group), in the order they were started, as a GPU stream runs them.

    Why: with two worker threads running a group's async collectives side by side, torch 2.13's gloo
    has corrupted the heap (glibc: "unaligned tcache chunk", "free(): invalid pointer", in a gloo
    worker thread) in a pure torch + gloo reproduction of Megatron-FSDP's overlapped all-gathers, and
    once in our CI. One thread per group keeps megatron-core's async calls and their overlap code paths
    as they are (same operations, same order, same numbers); only their concurrency inside one group goes.
    """
    import torch.distributed.distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_megatron_recipes_one_thread", False):
        return

    class OneWorkerThreadGloo(base):
        _megatron_recipes_one_thread = True

        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            options = base._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [base.create_default_device()]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneWorkerThreadGloo


class _EngineInMode:
    """The autograd engine with the CUDA->CPU mode on while it runs.

    ``Tensor.backward``/``torch.autograd.backward``/``grad`` reach the mode's handler first, and a handler
    runs with its mode popped, so the whole backward pass (custom Functions' backward, full activation
    recompute, the MoE dispatchers' backward, all calling ``torch.cuda.current_device()``) would run
    without it. Every backward entry ends in this engine's ``run_backward``, so the mode is put back here.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.overrides import _get_current_function_mode_stack

        if _MODE is None or _MODE in _get_current_function_mode_stack():
            return self._engine.run_backward(*args, **kwargs)
        with _MODE:
            return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _patch_autograd_engine() -> None:
    from torch.autograd.variable import Variable

    if not isinstance(Variable._execution_engine, _EngineInMode):
        Variable._execution_engine = _EngineInMode(Variable._execution_engine)


def activate() -> bool:
    """Patch torch/megatron-core for CPU execution. Idempotent; refuses when CUDA is present."""
    global _ACTIVE, _MODE
    if _ACTIVE:
        return True
    if not needed():
        raise RuntimeError(
            "the CPU lane patches CUDA entry points process-wide and must not run on a machine with CUDA; "
            "this machine has a GPU, so train on it directly"
        )
    _patch_cuda_namespace()
    patches.apply("cpu_lane")  # megatron-core's own CUDA-only corners (runtime/patches/)
    patches.apply("no_te")  # and its fallbacks without TE, which no CPU runs (also applied by the model builder)
    _patch_tensor_type()
    _patch_record_stream()
    _patch_all_to_all()
    _one_gloo_worker_thread()
    _patch_autograd_engine()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ACTIVE = True
    if os.environ.get("RANK", "0") == "0":  # every rank activates it; one line in the log says so
        log.warning(
            "CPU lane active: no CUDA device found, running megatron-core on CPU over gloo "
            "(for correctness and layout debugging, not speed)"
        )
    return True
