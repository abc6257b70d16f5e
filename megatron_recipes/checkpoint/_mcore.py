"""megatron-core distributed checkpointing as this project uses it: torch_dist format, fully parallel save.

Why the save once hung on CPU/gloo (megatron-core 0.16.1, read from its source): every torch_dist save
goes through ``FileSystemWriterAsync.prepare_write_data``, which fetches a module-global results queue
from ``filesystem_async._get_write_results_queue()``; the first call creates it as
``multiprocessing.get_context("spawn").Manager().Queue()``. Starting a *spawn* Manager launches a fresh
interpreter that re-imports the parent's ``__main__`` (as ``__mp_main__``) before it can serve. An entry
script without an ``if __name__ == "__main__":`` guard therefore runs the whole training script again in
that child: it calls ``init_process_group`` with the parent's RANK/MASTER_PORT and blocks in rendezvous
(or dies on the port), while the parent blocks forever in ``Manager.start()`` waiting for the child's
address. Separately, each forked writer calls ``psutil`` before its error handling, so without psutil a
writer dies silently and the parent waits forever on its completion queue.

The queue only carries results back to the process that saves when the save is synchronous, and ours
are, so each save runs under the ``save`` patch of ``runtime/patches/``: an in-process ``queue.Queue``
in that slot for the duration of the save (no Manager, no re-imported entry script; format, strategies
and resharding exactly megatron-core's). psutil is checked up front with a clear error.
"""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from megatron_recipes.checkpoint import _adapters
from megatron_recipes.checkpoint._trust import UntrustedCheckpoint, causes, find_refusal
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.runtime import collectives, mcore_compat, patches

log = logging.getLogger(__name__)

# Distributed-optimizer state formats megatron-core 0.16 offers (DistributedOptimizer.sharded_state_dict):
#   fully_reshardable - canonical per-parameter tensors; reshards across TP/PP/VPP/EP *and* DP. Gathers the
#                       optimizer shards to DP rank 0 of each model-parallel group at save time.
#   dp_reshardable    - the raw flat buffers, saved without communication; only DP may change on resume.
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
RNG_KEY = "rng_state"


def unwrap(chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """GPTModel chunks from what the trainer holds (DDP, Float16Module wrappers)."""
    from megatron.core.utils import unwrap_model

    return list(unwrap_model(list(chunks)))


def chunk_keys(num_chunks: int) -> List[str]:
    """Megatron-LM's names: ``model`` for one chunk, ``model0``, ``model1``... under VPP."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def sharded_metadata(optimizer_format: Optional[str]) -> Dict[str, Any]:
    """The ``metadata`` megatron-core's ``sharded_state_dict`` methods take (as Megatron-LM >= 0.14 passes it)."""
    meta: Dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer_format is not None:
        meta["distrib_optim_sharding_type"] = optimizer_format
        # Gather to DP rank 0 over gloo into host memory instead of all-gathering on every GPU.
        meta["distrib_optim_fully_reshardable_mem_efficient"] = True
    return meta


def content_metadata(metadata: Dict[str, Any]) -> Dict[str, Any]:
    """The plain values of ``metadata`` megatron-core stores with the checkpoint (``content_metadata``)."""
    return {k: v for k, v in metadata.items() if isinstance(v, (str, int, float, bool))}


def model_state(chunks: List[torch.nn.Module], metadata: Dict[str, Any]) -> Dict[str, Any]:
    models = unwrap(chunks)  # adapters only, for models that have them
    return {key: _adapters.model_state(m, metadata) for key, m in zip(chunk_keys(len(models)), models)}


def optimizer_state(optimizer, model_sd: Dict[str, Any], metadata: Dict[str, Any], is_loading: bool):
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)


def optimizer_parts(optimizer) -> int:
    """How many optimizers megatron-core chained: one per distinct data-parallel group (dense, experts)."""
    return len(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def regroup_optimizer_state(loaded: Dict[Any, Any], saved_parts: int, parts_now: int) -> Dict[Any, Any]:
    """Fit the optimizer's non-tensor state (param groups, step) to today's number of chained optimizers.

    megatron-core builds a separate optimizer for expert parameters when their data-parallel group differs
    from the dense one (EP > 1), and one otherwise; a ChainedOptimizer's state is keyed 0, 1, ... The
    tensor state (fully_reshardable) is keyed by parameter and reshards by itself, but the common part
    comes back in the saved structure. Param groups are matched by their identity keys (wd_mult, lr_mult,
    is_expert_parallel...), so every part gets all saved groups.
    """
    if saved_parts == parts_now:
        return loaded
    saved = [loaded[i] for i in range(saved_parts)] if saved_parts > 1 else [loaded]
    groups = [group for part in saved for group in part["optimizer"]["param_groups"]]
    extras = {k: v for part in saved for k, v in part.items() if k not in ("optimizer", "param_state")}
    tensors = [loaded[i]["param_state"] for i in range(parts_now)] if parts_now > 1 else [loaded["param_state"]]
    rebuilt = [dict(extras, optimizer={"param_groups": groups}, param_state=t) for t in tensors]
    return {i: part for i, part in enumerate(rebuilt)} if parts_now > 1 else rebuilt[0]


# Param-group values the recipe sets (optimizer.lr, min_lr, weight_decay) and the scheduler reads from each group;
# the other identity keys describe which parameters a group holds. A resume keeps the groups, takes these
# from the recipe: saved ones made a changed optimizer.lr silently ignored (0.16: the loaded groups kept the
# old max_lr) or a KeyError inside megatron-core (0.19 matches groups by all of them).
_SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
_GROUP_KEYS = ("wd_mult", "pre_wd_mult", "lr_mult", "pre_lr_mult", "is_expert_parallel", "is_decoupled_lr", "optimizer")


def _group_kind(group: Dict[str, Any]) -> tuple:
    return tuple((k, repr(group.get(k))) for k in _GROUP_KEYS)


def _saved_groups(loaded: Dict[Any, Any]) -> List[Dict[str, Any]]:
    parts = [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))] or [loaded]
    return [g for part in parts for g in (part.get("optimizer") or {}).get("param_groups", [])]


def take_schedule_from_recipe(optimizer, loaded: Dict[Any, Any]) -> None:
    """Each saved param group's schedule values become those this run's optimizer was built with."""
    now: Dict[tuple, Dict[str, Any]] = {}
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for group in getattr(getattr(part, "optimizer", None), "param_groups", []):
            now.setdefault(_group_kind(group), {k: group[k] for k in _SCHEDULE_KEYS if k in group})
    for group in _saved_groups(loaded):
        values = now.get(_group_kind(group))
        if values is not None:
            group.update(values)


def load_optimizer(optimizer, loaded: Dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` with the schedule values of this run's recipe
    (``take_schedule_from_recipe``), plus a fix for a megatron-core 0.16 bug that breaks exact resume.

    Without Apex/Transformer Engine (the CPU lane, or a GPU image without them) its
    ``DistributedOptimizer.load_state_dict`` gives every parameter's Adam state the *same* ``step``
    tensor; torch's Adam increments ``step`` in place once per parameter, so after the first resumed
    step the bias correction uses step+N for N parameters. Each parameter gets its own copy here.
    """
    take_schedule_from_recipe(optimizer, loaded)
    optimizer.load_state_dict(loaded)
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        for param_state in getattr(inner, "state", {}).values():
            step = param_state.get("step") if isinstance(param_state, dict) else None
            if torch.is_tensor(step):
                param_state["step"] = step.clone()


# --- RNG: every rank's own streams, so a resumed run draws exactly what the uninterrupted one would ---


def capture_rng() -> Dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        # On the CPU lane megatron-core's "CUDA" tracker streams are CPU generator states (see cpu_lane).
        "tracker": {name: state.clone() for name, state in get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng(rng: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(dict(rng["tracker"]))


def rng_object(rng: Optional[Dict[str, Any]] = None):
    """One shard per global rank (restored only when the layout and world size are unchanged)."""
    from megatron.core.dist_checkpointing import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject(RNG_KEY, rng, (world,), (rank,), replica_id=0)


# --- the loop's own state: stored in megatron-core's common.pt, read back with torch.load(weights_only) ---

_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def check_plain(value: Any, where: str = "state") -> None:
    """``state`` must survive ``torch.load(weights_only=True)``: plain values, containers and tensors."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise RecipeError(f"{where} has a key of type {type(key).__name__}", fix="use str or int keys")
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    raise RecipeError(
        f"checkpoint {where} holds a {type(value).__module__}.{type(value).__name__}, which a checkpoint cannot "
        "reload safely (megatron-core reads it with torch.load(weights_only=True))",
        fix="store plain values (numbers, strings, lists, dicts) or tensors; RNG streams are saved by the "
        "checkpoint engine itself, per rank",
    )


# --- megatron-core save / load ---


def _require_psutil() -> None:
    try:
        import psutil  # noqa: F401  (megatron-core's writer processes need it)
    except ImportError:
        raise RecipeError(
            "psutil is not installed; megatron-core's checkpoint writer needs it (without it the save hangs)",
            fix="pip install psutil",
        ) from None


def _dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _comparable_common(common: Dict[str, Any]) -> Dict[str, Any]:
    """The common state ranks must agree on. Optimizer ``param_state`` differs by design (gathered to DP
    rank 0 only), so megatron-core's consistency check would warn on every save; it is left out of it."""

    def strip(tree: Any) -> Any:
        return {k: strip(v) for k, v in tree.items() if k != "param_state"} if isinstance(tree, dict) else tree

    return {key: strip(value) if key == "optimizer" else value for key, value in common.items()}


def save(sharded_sd: Dict[str, Any], directory: Path, content_metadata: Dict[str, Any]) -> None:
    """megatron-core ``dist_checkpointing.save`` (torch_dist), the writes spread over data-parallel ranks."""
    from megatron.core import dist_checkpointing

    strategy = _save_strategy()
    with patches.applied("save"):
        dist_checkpointing.save(
            sharded_sd,
            str(directory),
            sharded_strategy=strategy,
            content_metadata=dict(content_metadata),
            preprocess_common_before_consistancy_check=_comparable_common,
        )


def _save_strategy():
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    _require_psutil()
    threads = 2 if torch.cuda.is_available() else 1  # writer processes per rank; one suffices on CPU
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=threads)
    group = _dp_group()
    return FullyParallelSaveStrategyWrapper(strategy, group) if group.size() > 1 else strategy


def save_async(sharded_sd: Dict[str, Any], directory: Path, content_metadata: Dict[str, Any]):
    """megatron-core's async ``dist_checkpointing.save``: plans and stages now (collective), returns the
    ``AsyncRequest`` whose write runs in a forked process; its finalize functions (every rank, after every
    rank's write) check the results and write ``metadata.json``."""
    from megatron.core import dist_checkpointing

    with patches.applied("async_save"):  # the writer's results queue, from a fork-started Manager
        return dist_checkpointing.save(
            sharded_sd,
            str(directory),
            sharded_strategy=_save_strategy(),
            async_sharded_save=True,
            **mcore_compat.async_save_options(),
            content_metadata=dict(content_metadata),
            preprocess_common_before_consistancy_check=_comparable_common,
        )


def state_bytes(sharded_sd: Dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in ``sharded_sd`` (main replicas only: what it may write)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    total = 0
    for item in nested_values(sharded_sd):
        data = getattr(item, "data", None) if isinstance(item, ShardedTensor) else item
        if torch.is_tensor(data) and not _is_replica(getattr(item, "replica_id", 0)):
            total += data.numel() * data.element_size()
    return total


def _is_replica(replica_id: Any) -> bool:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return any(int(i) != 0 for i in ids)


def load(sharded_sd: Dict[str, Any], directory: Path) -> Dict[str, Any]:
    """megatron-core ``dist_checkpointing.load``; each DP rank reads part and they exchange the rest."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    strategy = TorchDistLoadShardedStrategy()
    group = _dp_group()
    if group.size() > 1:
        strategy = FullyParallelLoadStrategyWrapper(strategy, group)
    return dist_checkpointing.load(sharded_sd, str(directory), sharded_strategy=strategy)


def load_allowing_absent_extra_states(sharded_sd: Dict[str, Any], directory: Path) -> Dict[str, Any]:
    """``load``, except that requested ``*._extra_state`` objects the checkpoint lacks come back as ``None``.

    Transformer Engine modules carry ``_extra_state`` (FP8 scaling history); checkpoints written without
    TE (the CPU lane, ``convert import``) have none. ``None`` is what TE's ``set_extra_state`` treats as
    "keep the defaults", so a CPU-written checkpoint loads on a TE GPU. Every other missing key still
    fails the load.
    """
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_outplace,
        extract_matching_values,
        merge,
        nested_values,
    )
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    def extra_state(x: Any) -> bool:
        return isinstance(x, ShardedObject) and x.key.endswith("_extra_state")

    if not any(extra_state(x) for x in nested_values(sharded_sd)):
        return load(sharded_sd, directory)
    stored = {x.key for x in load_sharded_metadata(str(directory)).values() if isinstance(x, ShardedObject)}
    absent, present = extract_matching_values(sharded_sd, lambda x: extra_state(x) and x.key not in stored)
    if not absent:
        return load(sharded_sd, directory)
    return merge(load(present, directory), dict_list_map_outplace(lambda _: None, absent))


def tensor_mismatches(sharded_sd: Dict[str, Any], directory: Path, limit: int = 12) -> List[str]:
    """Requested tensors the checkpoint lacks or holds with another global shape (this rank's view)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    try:
        stored = dist_checkpointing.load_tensors_metadata(str(directory))
    except UntrustedCheckpoint:
        raise
    except Exception as exc:  # a torn or foreign .metadata file: report instead of a stack of internals
        return [f"its tensor index (.metadata) cannot be read: {exc}"]
    requested, _, _ = load_preprocess(sharded_sd)  # works on a copy: factories applied, data untouched
    found = []
    for item in nested_values(requested):
        if not isinstance(item, ShardedTensor):
            continue
        saved = stored.get(item.key)
        if saved is None:
            found.append(f"{item.key}: not in the checkpoint")
        elif tuple(saved.global_shape) != tuple(item.global_shape):
            found.append(f"{item.key}: checkpoint shape {tuple(saved.global_shape)}, model {tuple(item.global_shape)}")
    return sorted(set(found))[:limit]


def all_ranks(items: List[str]) -> List[str]:
    """The union of every rank's list (so every rank raises the same error, none waits in a collective)."""
    gathered: List[Optional[List[str]]] = collectives.all_gather_object(items)
    return sorted({item for rank_items in gathered for item in (rank_items or [])})


def root_cause(exc: BaseException) -> str:
    """One line for a failed read or write: the innermost error's type and first line, no stack.

    torch DCP's CheckpointException puts every rank's traceback into its message; users need the cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    inner = [e for e in causes(exc) if not isinstance(e, CheckpointException)] or [exc]
    chosen = inner[-1]
    lines = [ln.strip() for ln in str(chosen).splitlines() if ln.strip()]
    return f"{type(chosen).__name__}: {lines[0][:300]}" if lines else f"{type(chosen).__name__} (the file ends early or is damaged)"


def unreadable(ckpt: Path, exc: BaseException) -> Exception:
    """What to raise when a checkpoint fails to load: a file that would run code said as such (not
    "damaged"), else a damaged-checkpoint error with its root cause."""
    refusal = find_refusal(exc)
    if refusal is not None:
        refusal.__suppress_context__ = True  # as ``raise refusal from None``: the refusal is the whole story
        return refusal
    error = RecipeError(
        f"checkpoint '{ckpt}' could not be read ({root_cause(exc)})",
        fix="the checkpoint is damaged or was copied incompletely; use another one (e.g. the previous "
        "iteration). The model in memory may be partly loaded: start again rather than train on",
    )
    error.__cause__ = exc
    return error


def disk_full(exc: BaseException) -> bool:
    """Whether a save failed for lack of space (or quota), wherever in megatron-core/torch it surfaced."""
    return any(
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in str(e)
        for e in causes(exc)
    )


def megatron_core_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except ImportError:
        return "unknown"
