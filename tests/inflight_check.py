"""Debug check: no storage of a tensor handed to an unfinished gloo collective is resized (freed) before wait.

gloo runs every collective on a background thread that reads and writes raw pointers of its tensors; on
the CPU lane streams and events are no-ops, so memory an accelerator keeps alive stream-ordered is only
safe here if ``Work.wait()`` came first. ``install()`` wraps the ProcessGroup collectives and storage
resizes of this process; a resize of an in-flight storage raises (with both stacks) instead of
corrupting the heap later.
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
_INFLIGHT: Dict[int, Tuple[Any, List[Tuple[int, int]], str]] = {}  # id(work) -> (work, [(ptr, nbytes)], stack)
VIOLATIONS: List[str] = []
CALLS: Dict[str, int] = {}
MAX_INFLIGHT = [0]
_INSTALLED = False


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _track(name: str, original):
    def call(self, *args, **kwargs):
        work = original(self, *args, **kwargs)
        CALLS[name] = CALLS.get(name, 0) + 1
        spans = []
        for t in _tensors(list(args) + list(kwargs.values())):
            s = t.untyped_storage()
            if s.nbytes():
                spans.append((s.data_ptr(), s.nbytes()))
        if isinstance(work, Work) and spans:
            with _LOCK:
                _INFLIGHT[id(work)] = (work, spans, f"{name}\n" + "".join(traceback.format_stack(limit=14)[:-1]))
                MAX_INFLIGHT[0] = max(MAX_INFLIGHT[0], sum(not w.is_completed() for w, _, _ in _INFLIGHT.values()))
        return work

    return call


def _untrack(original):
    def wait(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        with _LOCK:
            _INFLIGHT.pop(id(self), None)
        return result

    return wait


def _checked_resize(original):
    def resize_(self, size):
        CALLS['resize_'] = CALLS.get('resize_', 0) + 1
        ptr, nbytes = self.data_ptr(), self.nbytes()
        if nbytes:
            with _LOCK:
                hits = [(w, stack) for w, spans, stack in _INFLIGHT.values()
                        if any(p < ptr + nbytes and ptr < p + n for p, n in spans)]
            if hits:
                message = (f"storage {ptr:#x} ({nbytes} B) resized to {size} B while a collective using it is in "
                           f"flight (no wait yet).\nresize at:\n{''.join(traceback.format_stack(limit=14)[:-1])}"
                           f"collective issued at: {hits[0][1]}")
                VIOLATIONS.append(message)
                raise RuntimeError(message)
        return original(self, size)

    return resize_


def install() -> None:
    """Wrap this process's collectives and storage resizes (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for name in _METHODS:
        if hasattr(ProcessGroup, name):
            setattr(ProcessGroup, name, _track(name, getattr(ProcessGroup, name)))
    Work.wait = _untrack(Work.wait)
    torch.UntypedStorage.resize_ = _checked_resize(torch.UntypedStorage.resize_)
    _INSTALLED = True


def in_flight() -> List[str]:
    """Stacks of collectives issued and not yet waited for (nor completed)."""
    with _LOCK:
        return [stack for work, _, stack in _INFLIGHT.values() if not work.is_completed()]


def never_waited() -> List[str]:
    with _LOCK:
        return [stack for work, _, stack in _INFLIGHT.values()]
