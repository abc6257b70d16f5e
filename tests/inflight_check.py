"""Debug check for the CPU lane: no tensor handed to an unfinished gloo collective is freed or touched before wait.

On a GPU, Megatron-FSDP keeps collective buffers alive stream-ordered (side streams, events, the caching
allocator). The CPU lane makes streams and events no-ops, while gloo runs each collective on a background
thread that reads and writes its tensors' memory until ``Work.wait()``. So the lane is only safe if every
free (``storage.resize_(0)``) or use of such memory on the calling thread comes after that wait. ``install()``
wraps this process's ProcessGroup collectives, ``Work.wait`` and storage resizes: a resize of an in-flight
storage raises (naming where the collective was issued); ``access_mode()`` also records every ATen op of
this thread that touches an in-flight tensor outside ``wait`` (``ACCESSES``).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Dict, List, Tuple

import torch
from torch._C._distributed_c10d import ProcessGroup, Work

_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
            "all_gather_single", "all_gather_single_coalesced", "_allgather_base", "reduce_scatter",
            "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
            "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter", "alltoall", "alltoall_base",
            "all_to_all_single", "send", "recv", "recv_anysource")
_LOCK = threading.Lock()
_LOCAL = threading.local()  # in_wait: this thread is inside Work.wait (which may copy results itself)
_INFLIGHT: Dict[int, Tuple[Any, List[Tuple[int, int]], str]] = {}  # id(work) -> (work, [(ptr, nbytes)], issued at)
VIOLATIONS: List[str] = []
ACCESSES: List[Tuple[str, str]] = []  # (op, where the collective was issued)
_INSTALLED = False


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _span(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own; its local tensor is checked
        return None


def _stack() -> str:
    return "".join(traceback.format_stack(limit=12)[:-2])


def _track(name: str, original):
    def call(self, *args, **kwargs):
        work = original(self, *args, **kwargs)
        spans = [s for s in map(_span, _tensors(list(args) + list(kwargs.values()))) if s and s[1]]
        if isinstance(work, Work) and spans:
            with _LOCK:
                _INFLIGHT[id(work)] = (work, spans, f"{name} issued at\n{_stack()}")
        return work

    return call


def _untrack(original):
    def wait(self, *args, **kwargs):
        _LOCAL.in_wait = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _LOCAL.in_wait = False
            with _LOCK:
                _INFLIGHT.pop(id(self), None)

    return wait


def _hits(ptr: int, nbytes: int) -> List[str]:
    with _LOCK:
        return [issued for _, spans, issued in _INFLIGHT.values() if any(p < ptr + nbytes and ptr < p + n for p, n in spans)]


def _checked_resize(original):
    def resize_(self, size):
        if self.nbytes():
            hits = _hits(self.data_ptr(), self.nbytes())
            if hits:
                message = (f"a storage of {self.nbytes()} B is resized to {size} B while a collective using it has "
                           f"not been waited for.\nresize at\n{_stack()}{hits[0]}")
                VIOLATIONS.append(message)
                raise RuntimeError(message)
        return original(self, size)

    return resize_


def install() -> None:
    """Wrap this process's collectives, ``Work.wait`` and storage resizes (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name in _METHODS:
        if hasattr(ProcessGroup, name):
            setattr(ProcessGroup, name, _track(name, getattr(ProcessGroup, name)))
    Work.wait = _untrack(Work.wait)
    torch.UntypedStorage.resize_ = _checked_resize(torch.UntypedStorage.resize_)
    _INSTALLED = True


def access_mode():
    """A TorchDispatchMode recording (in ``ACCESSES``) each op of this thread on an in-flight tensor outside wait."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class InFlightAccess(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _INFLIGHT and not getattr(_LOCAL, "in_wait", False):
                for t in _tensors(list(args) + list(kwargs.values())):
                    span = _span(t) if t.device.type == "cpu" else None
                    if span and span[1]:
                        ACCESSES.extend((str(func), issued) for issued in _hits(*span))
            return func(*args, **kwargs)

    return InFlightAccess()
