"""The one place that calls ``torch.distributed`` collectives (tests/test_collectives.py enforces it).

Why: on GPUs megatron-core's groups (and the default one) are NCCL groups, which refuse host tensors
("No backend type associated with device type cpu"), while on the CPU lane every group is gloo and
every tensor is a host tensor, so a collective fed a tensor built on the host passes every test here
and crashes the first GPU run. Two kinds of entry point keep that from happening again:

- ``all_reduce_values``: Python numbers in, Python numbers out; this module puts them on the device the
  group's backend takes (NCCL: the current CUDA device; gloo: the host).
- thin wrappers for tensors the caller already holds on the run's device (``all_reduce``,
  ``reduce_scatter_tensor``): they check the tensor's device against the group's backend and raise
  ``CollectiveDeviceError`` naming both, instead of the backend's cryptic refusal or a hang.
- object collectives and ``barrier`` need no device from the caller (torch picks it per backend); they
  live here so that no other module calls a collective.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

Number = Union[int, float]
Op = Union[str, dist.ReduceOp]

# The device types each backend takes tensors on. gloo's partial CUDA support (all_reduce and broadcast
# only) is left out on purpose: none of our collectives need it, and it would hide a wrong device.
_BACKEND_DEVICE_TYPES = {
    "nccl": ("cuda",),
    "gloo": ("cpu",),
    "mpi": ("cpu", "cuda"),
    "ucc": ("cpu", "cuda"),
}
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


class CollectiveDeviceError(RuntimeError):
    """A tensor on a device the group's backend does not take (a host tensor on an NCCL group)."""


def device_types(backend: str) -> Tuple[str, ...]:
    """Device types a backend string takes, e.g. "nccl" -> ("cuda",), "cpu:gloo,cuda:nccl" -> ("cpu", "cuda").

    A default group started without a backend has one backend per device type, spelled out in the string."""
    text = str(backend).lower()
    if ":" in text:
        return tuple(sorted({part.split(":", 1)[0].strip() for part in text.split(",") if part.strip()}))
    if text not in _BACKEND_DEVICE_TYPES:
        raise ValueError(f"unknown torch.distributed backend {backend!r}: known are {sorted(_BACKEND_DEVICE_TYPES)}")
    return _BACKEND_DEVICE_TYPES[text]


def host_value_device_type(backend: str) -> str:
    """Where host values go for a collective on ``backend``: the host when the backend takes host tensors
    (gloo, or a default group with a CPU backend: no copy to the device and back), else the CUDA device."""
    types = device_types(backend)
    if "cpu" in types:
        return "cpu"
    if "cuda" in types:
        return "cuda"
    raise ValueError(f"backend {backend!r} takes neither host nor CUDA tensors ({types})")


def check_device(tensor: torch.Tensor, backend: str, what: str) -> None:
    """Raise ``CollectiveDeviceError`` when ``backend`` does not take tensors on ``tensor``'s device."""
    types = device_types(backend)
    if tensor.device.type not in types:
        raise CollectiveDeviceError(
            f"{what} on a {backend} process group got a tensor on {tensor.device}; {backend} takes tensors on "
            f"{' or '.join(types)}: build it on the run's device, or pass Python numbers to "
            "megatron_recipes.runtime.collectives.all_reduce_values"
        )


def _backend(group: Optional[Any]) -> str:
    return str(dist.get_backend(group))


def _device(device_type: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


def _op(op: Op) -> dist.ReduceOp:
    if isinstance(op, str):
        if op.lower() not in _OPS:
            raise ValueError(f"unknown reduction {op!r}: one of {sorted(_OPS)}")
        return getattr(dist.ReduceOp, _OPS[op.lower()])
    return op


def all_reduce_values(values: Sequence[Number], op: Op = "sum", group: Optional[Any] = None) -> List[Number]:
    """``values`` reduced over ``group``, as Python numbers on every rank.

    All ints (bools count as ints) reduce as int64 and come back as ints; otherwise float64 and floats."""
    integral = all(isinstance(v, (int, bool)) for v in values)
    dtype = torch.int64 if integral else torch.float64
    backend = _backend(group)
    t = torch.tensor(list(values), dtype=dtype, device=_device(host_value_device_type(backend)))
    dist.all_reduce(t, op=_op(op), group=group)
    return t.tolist()


def all_reduce(tensor: torch.Tensor, op: Op = "sum", group: Optional[Any] = None) -> torch.Tensor:
    """In-place all-reduce of a tensor the caller holds on the run's device (checked); returns it."""
    check_device(tensor, _backend(group), "all_reduce")
    dist.all_reduce(tensor, op=_op(op), group=group)
    return tensor


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Op = "sum", group: Optional[Any] = None) -> None:
    """Reduce-scatter of buffers the caller holds on the run's device (both checked)."""
    backend = _backend(group)
    check_device(input, backend, "reduce_scatter_tensor (input)")
    check_device(output, backend, "reduce_scatter_tensor (output)")
    dist.reduce_scatter_tensor(output, input, op=_op(op), group=group)


def barrier(group: Optional[Any] = None) -> None:
    dist.barrier(group=group)


def broadcast_objects(objects: List[Any], src: int = 0, group: Optional[Any] = None) -> List[Any]:
    """``objects`` (a list, filled in place on the other ranks) as ``src`` holds it; picklable items."""
    dist.broadcast_object_list(objects, src=src, group=group)
    return objects


def all_gather_object(obj: Any, group: Optional[Any] = None) -> List[Any]:
    """Every rank's ``obj`` in rank order (picklable)."""
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
