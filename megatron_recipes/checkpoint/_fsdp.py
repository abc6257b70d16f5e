"""Checkpoints of Megatron-FSDP runs (``parallel.fsdp=true``): save, resume, and resharding to other layouts.

Why a second tensor format: in megatron-core 0.16.1 ``MegatronFSDP`` has no ``sharded_state_dict`` and the
``DistributedOptimizer`` of an FSDP model raises NotImplementedError for every
``distrib_optim_sharding_type`` except ``fsdp_dtensor`` (optimizer/distrib_optimizer.py), so the torch_dist
checkpoints of ``_mcore`` cannot hold an FSDP run. As Megatron-LM's ``ckpt_format=fsdp_dtensor``
does, the model's own ``state_dict()`` (its parameters as unevenly sharded DTensors, named
``module.<GPTModel name>``) and ``optimizer.sharded_state_dict(metadata={"distrib_optim_sharding_type":
"fsdp_dtensor"})`` (Adam moments as DTensors, keyed by parameter name) go through megatron_fsdp's
``preprocess_state_dict_for_uneven_dtensor`` and torch.distributed.checkpoint. The folder, tracker,
meta.json (``"backend": "fsdp_dtensor"``) and config.yaml are written by ``checkpoint`` as for torch_dist.

Each DTensor is stored whole (its global shape), so the files also hold every weight under its
layout-free name. That is what resharding to a non-FSDP layout reads (``load_weights_into_plain``):
megatron-core's own ``sharded_state_dict`` of the target model names, for each of its tensors, the
global tensor and the region this rank holds (TP slices, gated-FC1 halves, global layer numbers under
PP). The reverse direction loads a torch_dist checkpoint into the bare model before Megatron-FSDP wraps
it (``checkpointing.load_pretrained_before_fsdp``). Optimizer state does not cross between the two
formats (see ``_refuse_cross_resume``).
"""

from __future__ import annotations

import io as bytes_io
import re
from pathlib import Path
from typing import Any, Dict, List

import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.checkpoint import _adapters
from megatron_recipes.checkpoint import _identity as identity
from megatron_recipes.checkpoint import _mcore as io
from megatron_recipes.checkpoint._trust import restricted_loading
from megatron_recipes.runtime import collectives

BACKEND = "fsdp_dtensor"
MODEL_PREFIX = "module."  # FullyShardedDataParallel.state_dict(): "module." + the GPTModel's names
_LAYER = re.compile(r"^(.*?\.layers\.)(\d+)(\..*)$")
_READ_BATCH_BYTES = 1 << 30  # full tensors read per torch DCP call when resharding (bounds host memory)


def is_fsdp(chunks: List[torch.nn.Module]) -> bool:
    """Whether the trainer's chunks are wrapped by Megatron-FSDP."""
    return any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in chunks)


def is_fsdp_checkpoint(meta: Dict[str, Any]) -> bool:
    return meta.get("backend") == BACKEND


def _optimizer_metadata() -> Dict[str, Any]:
    return {**io.sharded_metadata(None), "distrib_optim_sharding_type": BACKEND}


def _model_state(chunks: List[torch.nn.Module]) -> Dict[str, Any]:
    """Each chunk's DTensor state dict; ``None`` entries (extra state of non-TE layers) hold nothing."""
    return {
        key: {name: value for name, value in chunk.state_dict().items() if value is not None}
        for key, chunk in zip(io.chunk_keys(len(chunks)), chunks)
    }


def _blob(value: Any) -> bytes_io.BytesIO:
    """Plain values (loop state, scheduler) as one torch.save blob, read back with weights_only=True."""
    buffer = bytes_io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _unblob(buffer: bytes_io.BytesIO) -> Any:
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _rng_key() -> str:
    return f"rank{torch.distributed.get_rank()}"


def _uneven(state: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron-FSDP's shards are uneven: record each one's offsets for torch DCP (collective)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    return preprocess_state_dict_for_uneven_dtensor(state)


def _reader(ckpt: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt))


def _dcp_load(state: Dict[str, Any], ckpt: Path, *, alone: bool = False) -> None:
    """torch DCP's in-place load; a damaged or foreign file becomes a RecipeError (as ``checkpoint._read``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        dcp.load(state, storage_reader=_reader(ckpt), no_dist=alone)
    except (Exception, CheckpointException) as exc:
        raise io.unreadable(ckpt, exc)


# --- save ---


def save(chunks: List[torch.nn.Module], optimizer, scheduler, state: Dict[str, Any], directory: Path) -> None:
    """Write this rank's part of an fsdp_dtensor checkpoint into ``directory`` (collective)."""
    import torch.distributed.checkpoint as dcp

    sd: Dict[str, Any] = _model_state(chunks)
    if optimizer is not None:
        sd["optimizer"] = _common_step(
            optimizer.sharded_state_dict(dict(sd), is_loading=False, metadata=_optimizer_metadata())
        )
    if scheduler is not None:
        sd["scheduler"] = _blob(scheduler.state_dict())
    sd["state"] = _blob(dict(state))
    sd["rng"] = {_rng_key(): io.capture_rng()}  # one key per rank: each rank writes its own streams
    dcp.save(_uneven(sd), storage_writer=dcp.FileSystemWriter(str(directory), thread_count=1))


def _common_step(optimizer_sd: Dict[Any, Any]) -> Dict[Any, Any]:
    """Every parameter's Adam ``step`` set to the optimizer's step count, in a copy of the state.

    Without Apex/TE (torch Adam) each parameter keeps its own ``step`` tensor, and a rank whose Megatron-FSDP
    shard of a parameter is empty never steps it (it stays 0 there). The tensor is not a DTensor, so torch
    DCP keeps one rank's copy of it: resumed, a rank that did update the parameter could get 0 and a
    different Adam bias correction (seen on the CPU lane: step 4 after a resume at 2 differed). Steps of
    empty shards are never used, so the count all ranks agree on, the maximum, is what is stored.
    """
    if "state" not in optimizer_sd:  # a ChainedOptimizer: one such dict per part
        return {key: _common_step(part) for key, part in optimizer_sd.items()}
    steps = [float(v["step"]) for v in optimizer_sd["state"].values() if isinstance(v, dict) and "step" in v]
    top = collectives.all_reduce_values([max(steps, default=0.0)], op="max")[0]  # the default group: NCCL on GPUs
    state = {}
    for name, value in optimizer_sd["state"].items():
        if isinstance(value, dict) and torch.is_tensor(value.get("step")):
            value = {**value, "step": torch.full_like(value["step"], top)}
        state[name] = value
    return {**optimizer_sd, "state": state}


# --- load ---


def _refuse_cross_resume(ckpt: Path, saved_fsdp: bool) -> None:
    saved, now = ("Megatron-FSDP", "a non-FSDP layout") if saved_fsdp else ("a non-FSDP layout", "Megatron-FSDP")
    raise RecipeError(
        f"checkpoint '{ckpt}' was saved under {saved}; this run would resume its optimizer state under {now}. "
        "megatron-core 0.16 stores the two optimizers' state in different formats (fsdp_dtensor: per-parameter "
        "DTensors of Megatron-FSDP's buffers; torch_dist: ShardedTensors of the distributed optimizer) and offers "
        "no conversion between them",
        fix=f"start from its weights with checkpoint.pretrained={ckpt} checkpoint.load=none (the optimizer and "
        "LR schedule start fresh), or resume with the parallel.fsdp setting it was saved with",
    )


def _check_same_ranks(ckpt: Path, saved_layout: Dict[str, Any], now: Dict[str, Any]) -> None:
    """Into a wrapped Megatron-FSDP model, only at the layout and world size it was saved with: that is what
    is proven here (resharding goes through ``checkpoint.pretrained``, which loads before wrapping)."""
    if not identity.same_ranks(saved_layout, now):
        raise RecipeError(
            f"checkpoint '{ckpt}' (Megatron-FSDP, {identity.describe(saved_layout)}) is resumed here only with "
            f"the layout and number of ranks it was saved with; this run has {identity.describe(now)}",
            fix=f"resume with {identity.describe(saved_layout)}, or start from its weights in any layout with "
            f"checkpoint.pretrained={ckpt} checkpoint.load=none (the optimizer and LR schedule start fresh)",
        )


def load(
    ckpt: Path,
    meta: Dict[str, Any],
    chunks: List[torch.nn.Module],
    optimizer,
    scheduler,
    now: Dict[str, Any],
    trust: bool,
) -> Dict[str, Any]:
    """Resume a Megatron-FSDP run from an fsdp_dtensor checkpoint; the saved loop ``state``.

    Same layout and world size required (``_check_same_ranks``); RNG streams are restored per rank.
    """
    saved_fsdp = is_fsdp_checkpoint(meta)
    if saved_fsdp != is_fsdp(chunks):
        if optimizer is not None or scheduler is not None:
            _refuse_cross_resume(ckpt, saved_fsdp)
        load_weights(ckpt, meta, chunks, now, trust)
        return _read_state(ckpt, meta, trust)
    saved_layout = meta.get("layout", {})
    _check_same_ranks(ckpt, saved_layout, now)
    sd: Dict[str, Any] = _model_state(chunks)
    if optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=True, metadata=_optimizer_metadata())
    if scheduler is not None:
        sd["scheduler"] = bytes_io.BytesIO()
    sd["state"] = bytes_io.BytesIO()
    with restricted_loading(trust):
        _check_keys(ckpt, sd)
        _dcp_load(_uneven(sd), ckpt)
        _install_weights(chunks, sd)
        if optimizer is not None:
            io.load_optimizer(optimizer, sd["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(_unblob(sd["scheduler"]))
        if meta.get("contents", {}).get("rng"):
            rng = {"rng": {_rng_key(): io.capture_rng()}}  # a template of the right shapes, overwritten
            _dcp_load(rng, ckpt, alone=True)  # this rank's own streams only
            io.restore_rng(rng["rng"][_rng_key()])
        state = _unblob(sd["state"])
    state.setdefault("step", meta.get("step"))
    return state


def _read_state(ckpt: Path, meta: Dict[str, Any], trust: bool) -> Dict[str, Any]:
    if not is_fsdp_checkpoint(meta):  # a torch_dist checkpoint's loop state is in megatron-core's common.pt
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        with restricted_loading(trust):
            state = dict(load_common_state_dict(str(ckpt)).get("state") or {})
    else:
        blob = {"state": bytes_io.BytesIO()}
        with restricted_loading(trust):
            _dcp_load(blob, ckpt, alone=True)
            state = _unblob(blob["state"])
    state.setdefault("step", meta.get("step"))
    return state


def _check_keys(ckpt: Path, sd: Dict[str, Any]) -> None:
    """Tensors the model asks for that the checkpoint lacks or holds with another shape: one clear error."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = _reader(ckpt).read_metadata().state_dict_metadata
    found = []
    for key, model in ((k, v) for k, v in sd.items() if k.startswith("model")):
        for name, value in model.items():
            if not torch.is_tensor(value):
                continue
            entry = stored.get(f"{key}.{name}")
            if not isinstance(entry, TensorStorageMetadata):
                found.append(f"{key}.{name}: not in the checkpoint")
            elif tuple(entry.size) != tuple(value.shape):
                found.append(f"{key}.{name}: checkpoint shape {tuple(entry.size)}, model {tuple(value.shape)}")
    found = io.all_ranks(found)
    if found:
        raise RecipeError(
            f"checkpoint '{ckpt}' does not fit this model:\n    " + "\n    ".join(found[:12]),
            fix="load a checkpoint of this model (compare its config.yaml with the recipe)",
        )


def _install_weights(chunks: List[torch.nn.Module], sd: Dict[str, Any]) -> None:
    """torch DCP filled the DTensors in place; ``load_state_dict`` runs Megatron-FSDP's post-load hook, which
    copies the (main) weights into the buffers the forward pass gathers from."""
    for key, chunk in zip(io.chunk_keys(len(chunks)), chunks):
        names = {name[len(MODEL_PREFIX):] for name in chunk.state_dict() if name.startswith(MODEL_PREFIX)}
        full = {name[len(MODEL_PREFIX):]: value for name, value in sd[key].items()}
        full.update({name: None for name in names - set(full)})  # extra state of non-TE layers: nothing saved
        chunk.load_state_dict(full, strict=True)


def load_weights(ckpt: Path, meta: Dict[str, Any], chunks: List[torch.nn.Module], now: Dict[str, Any], trust: bool) -> None:
    """Weights only, across formats where it can be done: fsdp_dtensor into Megatron-FSDP (same model-parallel
    layout) or into any non-FSDP layout; torch_dist into Megatron-FSDP only before wrapping."""
    if is_fsdp(chunks):
        if not is_fsdp_checkpoint(meta):
            raise RecipeError(
                f"checkpoint '{ckpt}' is a torch_dist checkpoint and this model is already wrapped by Megatron-FSDP",
                fix=f"give it as checkpoint.pretrained={ckpt} (loaded into the model before Megatron-FSDP shards it)",
            )
        _check_same_ranks(ckpt, meta.get("layout", {}), now)
        sd = _model_state(chunks)
        with restricted_loading(trust):
            _check_keys(ckpt, sd)
            _dcp_load(_uneven(sd), ckpt)
        _install_weights(chunks, sd)
        return
    saved_tp = int(meta.get("layout", {}).get("tp") or 1)
    if saved_tp != 1:
        raise RecipeError(
            f"checkpoint '{ckpt}' was saved under Megatron-FSDP with TP={saved_tp}; how its DTensors lay out the "
            "tensor-parallel slices (e.g. gated FC1's gate and up halves) is not proven, so it is not moved to "
            "other layouts (rule fsdp.checkpoint_format keeps FSDP checkpoints at TP=1)",
            fix="load it with Megatron-FSDP at the layout it was saved with",
        )
    with restricted_loading(trust):
        load_weights_into_plain(ckpt, io.unwrap(chunks))


# --- fsdp_dtensor -> any non-FSDP layout, through megatron-core's sharded_state_dict of the target ---


def _fsdp_name(name: str, sharded) -> str:
    """The checkpoint's name of a target tensor: global layer number from megatron-core's layer axis (a PP
    stage or VPP chunk numbers its layers from 0). Megatron-FSDP runs at PP=1: one saved chunk, ``model``."""
    prepend = getattr(sharded, "prepend_axis_num", 0)
    if prepend == 0:
        return f"model.{MODEL_PREFIX}{name}"
    match = _LAYER.match(name)
    if prepend != 1 or match is None:
        raise RecipeError(
            f"tensor {name} has {prepend} stacked axes in megatron-core's layout; moving Megatron-FSDP checkpoints "
            "of such models (experts, multi-token prediction) to other layouts is not supported",
            fix="resume it under Megatron-FSDP with the layout it was saved with",
        )
    return f"model.{MODEL_PREFIX}{match.group(1)}{sharded.global_offset[0]}{match.group(3)}"


def _region(sharded) -> tuple:
    prepend = sharded.prepend_axis_num
    return tuple(slice(o, o + s) for o, s in zip(sharded.global_offset[prepend:], sharded.local_shape))


def load_weights_into_plain(ckpt: Path, models: List[torch.nn.Module]) -> None:
    """Fill bare GPTModel chunks (any TP/PP/VPP, DDP or not) from an fsdp_dtensor checkpoint saved at TP=1.

    megatron-core's ``sharded_state_dict`` of each chunk, after its factories (gated FC1 -> gate and up
    halves), names every tensor's global shape and this rank's region of it; each full tensor is read
    with torch DCP (this rank alone, ``_READ_BATCH_BYTES`` at a time), sliced, and the result goes through
    megatron-core's factory merges and the module's strict ``load_state_dict``, as a torch_dist load would.
    """
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    stored = _reader(ckpt).read_metadata().state_dict_metadata
    for model in models:
        sharded, nonpersistent, factories = load_preprocess(model.sharded_state_dict(metadata=io.sharded_metadata(None)))
        wanted: Dict[str, List[Any]] = {}  # checkpoint name -> the target's ShardedTensors cut from it
        for name, entry in sharded.items():
            for item in entry if isinstance(entry, list) else [entry]:
                if isinstance(item, ShardedTensor):
                    wanted.setdefault(_fsdp_name(name, item), []).append(item)
        _check_stored(ckpt, wanted, stored)
        regions = _read_regions(ckpt, wanted, stored)

        def fill(item):
            if isinstance(item, ShardedTensor):
                return regions[id(item)]
            if isinstance(item, ShardedObject):  # extra state of non-TE layers: nothing was saved
                return None
            return item

        dict_list_map_inplace(fill, sharded)
        loaded = apply_factory_merges(sharded, factories)
        loaded.update(nonpersistent)
        if any(isinstance(v, (ShardedTensor, ShardedObject)) for v in nested_values(loaded)):
            raise RecipeError("internal: a sharded entry was left unfilled", fix="report this with the recipe")
        _adapters.load_model_state(model, loaded)


def _check_stored(ckpt: Path, wanted: Dict[str, List[Any]], stored) -> None:
    found = []
    for name, items in wanted.items():
        shape = tuple(items[0].global_shape[items[0].prepend_axis_num:])
        if name not in stored:
            found.append(f"{name}: not in the checkpoint")
        elif tuple(stored[name].size) != shape:
            found.append(f"{name}: checkpoint shape {tuple(stored[name].size)}, model {shape}")
    if found:
        raise RecipeError(
            f"checkpoint '{ckpt}' does not fit this model:\n    " + "\n    ".join(sorted(found)[:12]),
            fix="load a checkpoint of this model (compare its config.yaml with the recipe)",
        )


def _read_regions(ckpt: Path, wanted: Dict[str, List[Any]], stored) -> Dict[int, torch.Tensor]:
    """This rank's region of each wanted tensor: whole tensors are read (this rank alone, at most
    ``_READ_BATCH_BYTES`` at a time), cut, and dropped before the next batch."""

    regions: Dict[int, torch.Tensor] = {}
    names = list(wanted)
    while names:
        batch: Dict[str, torch.Tensor] = {}
        size = 0
        while names and (not batch or size < _READ_BATCH_BYTES):
            name = names.pop(0)
            batch[name] = torch.empty(tuple(stored[name].size), dtype=stored[name].properties.dtype)
            size += batch[name].numel() * batch[name].element_size()
        _dcp_load(batch, ckpt, alone=True)
        for name, whole in batch.items():
            for item in wanted[name]:
                regions[id(item)] = whole[_region(item)].clone()
    return regions
