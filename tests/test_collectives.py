"""One owner for torch.distributed collectives (``runtime/collectives.py``), and that owner's device rule.

Why: on the CPU lane every group is gloo and every tensor a host tensor, so a collective fed a tensor
built on the host passes here and crashes the first GPU run on an NCCL group (issue 24, findings 1-2:
PEFT's parameter counts, the FSDP checkpoint's Adam step). The AST check below makes every collective
go through the owner, which puts host values on the device the group's backend takes and refuses a
tensor on the wrong device with a clear error.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from multiproc import run_ranks

from megatron_recipes.runtime import collectives

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "megatron_recipes"
OWNER = LIBRARY / "runtime" / "collectives.py"
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "barrier", "monitored_barrier", "gather", "gather_object",
    "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
})
DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def _dotted(node: ast.AST) -> Optional[str]:
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def collective_calls(source: str, filename: str = "<source>") -> List[str]:
    """``file:line name`` of every call of a torch.distributed collective in ``source``, through the module
    path, an import alias (``import torch.distributed as dist``) or a ``from ... import`` of the function."""
    tree = ast.parse(source, filename)
    aliases: Dict[str, str] = {}  # local name -> what it stands for (module-wide: aliases are rarely rebound)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        module, _, function = full.rpartition(".")
        if module in DIST_MODULES and function in COLLECTIVES:
            found.append(f"{filename}:{node.lineno} {function}")
    return found


def test_no_module_outside_the_owner_calls_a_collective():
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path != OWNER:
            found += collective_calls(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not found, (
        "torch.distributed collectives outside megatron_recipes/runtime/collectives.py (on GPUs a host tensor on an "
        "NCCL group crashes; use collectives.all_reduce_values for Python numbers, or its thin wrappers):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n",
    "import torch\ntorch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)\n",
    "from torch.distributed import all_gather_object as gather\ngather(out, obj)\n",
    "from torch import distributed\ndistributed.barrier()\n",
    "import torch.distributed.distributed_c10d as c10d\nc10d.broadcast_object_list(objs, src=0)\n",
])
def test_the_checker_flags_a_collective_call(source):
    assert len(collective_calls(source, "snippet.py")) == 1


def test_the_checker_passes_clean_code():
    clean = (
        "import torch.distributed as dist\n"
        "from megatron_recipes.runtime import collectives\n"
        "rank = dist.get_rank() if dist.is_initialized() else 0\n"
        "dist.all_to_all_single = wrapper  # a patch assigns, it does not call\n"
        "collectives.all_reduce_values([rank], op='max')\n"
        "all_reduce(t)  # someone's own function of that name\n"
    )
    assert collective_calls(clean, "snippet.py") == []


# --- the owner's device rule ---


def test_host_values_go_where_the_backend_takes_them():
    assert collectives.host_value_device_type("nccl") == "cuda"
    assert collectives.host_value_device_type("gloo") == "cpu"
    # a default group started without a backend: gloo serves host tensors, no copy to the GPU and back
    assert collectives.device_types("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    assert collectives.host_value_device_type("cpu:gloo,cuda:nccl") == "cpu"
    assert collectives.host_value_device_type("cuda:nccl") == "cuda"
    with pytest.raises(ValueError, match="unknown torch.distributed backend"):
        collectives.device_types("carrier-pigeon")


def test_a_host_tensor_on_an_nccl_group_is_refused_by_name():
    with pytest.raises(collectives.CollectiveDeviceError, match=r"all_reduce on a nccl process group got a tensor on cpu"):
        collectives.check_device(torch.zeros(2), "nccl", "all_reduce")
    collectives.check_device(torch.zeros(2), "gloo", "all_reduce")  # the CPU lane's case passes
    collectives.check_device(torch.zeros(2), "cpu:gloo,cuda:nccl", "all_reduce")
    meta = torch.zeros(2, device="meta")  # a device gloo does not take: the same refusal without a GPU here
    with pytest.raises(collectives.CollectiveDeviceError, match="gloo takes tensors on cpu"):
        collectives.check_device(meta, "gloo", "all_reduce")


def _reduce_on_ranks() -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the owner is plain torch: no CPU lane, no megatron-core needed
    rank = dist.get_rank()
    out = {
        "sum_int": collectives.all_reduce_values([rank + 1, 10 * rank]),
        "max_int": collectives.all_reduce_values([rank, -rank], op="max"),
        "sum_float": collectives.all_reduce_values([0.5 + rank, 1e-3]),
        "max_float": collectives.all_reduce_values([float(rank) + 0.25], op=dist.ReduceOp.MAX),
        "objects": collectives.all_gather_object({"rank": rank}),
        "broadcast": collectives.broadcast_objects(["from rank 0" if rank == 0 else None], src=0),
    }
    t = torch.full((2,), float(rank + 1), dtype=torch.float64)
    out["tensor"] = collectives.all_reduce(t).tolist()
    try:
        collectives.all_reduce(torch.zeros(1, device="meta"))
    except collectives.CollectiveDeviceError as exc:
        out["refused"] = str(exc)
    collectives.barrier()
    return out


def test_all_reduce_values_on_two_gloo_ranks():
    for out in run_ranks(_reduce_on_ranks, 2):
        assert out["sum_int"] == [3, 10] and all(type(v) is int for v in out["sum_int"])
        assert out["max_int"] == [1, 0]
        assert out["sum_float"] == [2.0, 2e-3] and all(type(v) is float for v in out["sum_float"])
        assert out["max_float"] == [1.25]
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        assert out["broadcast"] == ["from rank 0"]
        assert out["tensor"] == [3.0, 3.0]
        assert "all_reduce on a gloo process group got a tensor on meta" in out["refused"]
