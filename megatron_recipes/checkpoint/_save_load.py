"""Save and load one checkpoint, collectively: every function here runs on every rank.

Tensors go through megatron-core's distributed checkpointing (``_mcore``), so a checkpoint saved at one
TP/PP/VPP/DP/EP layout loads at another; folders, the completion marker and retention are ``_files``;
what the checkpoint is *of* is ``_identity``; nothing in it runs code unless trusted (``_trust``).

Layout of ``root`` (the run's ``checkpoints/`` folder)::

    iter_0000200/                      megatron-core torch_dist files + meta.json + config.yaml
    iter_0000300/
    latest_checkpointed_iteration.txt  300 (replaced atomically, after the folder is complete)
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

import torch

from megatron_recipes import files
from megatron_recipes.checkpoint import _adapters
from megatron_recipes.checkpoint import _checksums as checksums
from megatron_recipes.checkpoint import _foreign as foreign
from megatron_recipes.checkpoint import _files as store
from megatron_recipes.checkpoint import _formats as formats
from megatron_recipes.checkpoint import _fsdp as fsdp_ckpt
from megatron_recipes.checkpoint import _identity as identity
from megatron_recipes.checkpoint import _mcore as io
from megatron_recipes.checkpoint import _run_identity as run_identity
from megatron_recipes.checkpoint._async import BackgroundSaves
from megatron_recipes.checkpoint._trust import restricted_loading
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.runtime import collectives

log = logging.getLogger(__name__)

T = TypeVar("T")


# --- collective helpers: rank 0 touches shared files, every rank sees the same outcome ---


def _require_dist() -> None:
    if not torch.distributed.is_initialized():
        raise RecipeError(
            "checkpoints are saved and loaded collectively, but torch.distributed is not initialised",
            fix="call megatron_recipes.runtime.distributed.init_model_parallel(cfg) first "
            "(a single process gets a one-rank group)",
        )


def on_rank0(what: str, fn: Callable[[], T]) -> Optional[T]:
    """Run ``fn`` on rank 0 and share its result; if it fails, every rank raises (none waits forever).

    Public for the loop's other rank-0 decisions (the run.dir lock)."""
    outcome: List[Any] = [None, None]  # [result, (message, fix) of a failure]
    if torch.distributed.get_rank() == 0:
        try:
            outcome[0] = fn()
        except RecipeError as exc:
            outcome[1] = (exc.message, exc.fix)
        except Exception as exc:  # shared with the other ranks, then raised on all of them below
            log.exception("%s failed", what)
            outcome[1] = (f"{what} failed on rank 0: {type(exc).__name__}: {exc}", None)
    collectives.broadcast_objects(outcome, src=0)
    if outcome[1] is not None:
        raise RecipeError(outcome[1][0], fix=outcome[1][1])
    return outcome[0]


def _is_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(isinstance(part, DistributedOptimizer) for part in parts)


def _optimizer_format(cfg: RunConfig, optimizer) -> Optional[str]:
    if optimizer is None or not _is_distributed_optimizer(optimizer):
        return None
    fmt, why = formats.choose(cfg)
    formats.say_once(fmt, why, torch.distributed.get_rank())
    return fmt


def _runtime_layout(cfg: Optional[RunConfig]) -> Dict[str, Any]:
    """This job's layout as megatron-core's parallel_state has it (the truth for RNG ownership)."""
    from megatron.core import parallel_state as ps

    uneven = {}
    if cfg is not None:  # uneven pipeline stages move layers between ranks
        uneven = {
            "num_layers_in_first_pipeline_stage": cfg.parallel.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": cfg.parallel.num_layers_in_last_pipeline_stage,
            "account_for_embedding_in_pipeline_split": cfg.parallel.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": cfg.parallel.account_for_loss_in_pipeline_split,
            "pipeline_layout": cfg.parallel.pipeline_layout,
        }
    return {
        **uneven,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world_size": torch.distributed.get_world_size(),
    }


def _check_same_sharding(ckpt: Path, saved: bool, now: bool) -> None:
    """A distributed optimizer's sharded state and a plain optimizer's are different structures (megatron-core
    fails with KeyError 'pre_wd_mult' halfway through the load)."""
    if saved != now:
        raise RecipeError(
            f"checkpoint '{ckpt}' holds {'distributed' if saved else 'non-distributed'} optimizer state, but this "
            f"run uses optimizer.use_distributed_optimizer={str(now).lower()}; one cannot be resumed as the other",
            fix=f"resume with optimizer.use_distributed_optimizer={str(saved).lower()}, or start from its weights "
            f"with checkpoint.pretrained={ckpt} checkpoint.load=none (the optimizer restarts)",
        )


# --- save ---


def _meta(step: int, cfg: RunConfig, n_chunks: int, optimizer, scheduler, fmt: Optional[str],
          record: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    meta = {
        "format": store.FORMAT,
        "format_version": store.FORMAT_VERSION,
        "complete": True,
        "step": step,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run_name": cfg.run.name,
        "launch_dir": os.getcwd(),  # where the run's relative paths (checkpoint.pretrained, data) start
        "fingerprint": identity.model_fingerprint(cfg),
        "layout": identity.layout(cfg),
        "contents": {
            "model_chunks": n_chunks,
            "optimizer": optimizer is not None,
            "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
            "optimizer_name": cfg.optimizer.name if optimizer is not None else None,
            "optimizer_format": fmt,
            "optimizer_parts": io.optimizer_parts(optimizer) if optimizer is not None else 0,
            "scheduler": scheduler is not None,
            "rng": True,
        },
        "backend": "torch_dist",
        "megatron_core_version": io.megatron_core_version(),
        "torch_version": torch.__version__,
    }
    if record is not None:  # what a resume must match (_run_identity): tokenizer, PEFT and its base, data
        meta[run_identity.KEY] = record
    return meta


def _finish(root: Path, step: int, meta: Dict[str, Any], cfg: RunConfig, keep_last: int) -> Path:
    """Rank 0, after every rank's shards are on disk: marker, rename, tracker, then retention."""
    import json

    from megatron_recipes.config.compose import to_yaml

    staging, final = store.staging_dir(root, step), store.iter_dir(root, step)
    files.write_text(staging / store.CONFIG, to_yaml(cfg))
    files.write_text(staging / store.META, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    store.publish(staging, final)
    store.write_tracker(root, step)
    for path in store.prune(root, keep_last):
        log.info("removed old checkpoint %s", path)
    return final


def save(
    root: Path,
    step: int,
    model_chunks: List[torch.nn.Module],
    optimizer,
    scheduler,
    state: Dict[str, Any],
    cfg: RunConfig,
    keep_last: int,
    background: Optional[BackgroundSaves] = None,
    record: Optional[Dict[str, Any]] = None,
) -> Path:
    """Save ``root/iter_{step:07d}`` and return it once complete (tracker updated, old ones pruned).

    With ``background`` (``checkpoint.async_save``) the write runs in the background: the save before it is
    completed first, and this one completes in ``background.poll()``/``wait()`` (``_async``).

    ``optimizer=None`` (with ``scheduler=None``) writes a weights-only checkpoint, e.g. a conversion.
    ``state`` holds the loop's global counters (step, consumed samples, data position): plain values or
    tensors, equal on every rank (rank 0's copy is stored). Each rank's RNG streams are saved separately.
    ``keep_last`` K > 0 keeps the newest K complete checkpoints; 0 keeps all. ``record`` is the run's
    identity a resume must match (``_run_identity.run_identity``), stored in meta.json.
    """
    _require_dist()
    if step < 0:
        raise RecipeError(f"checkpoint step {step} is negative", fix="save with the number of completed steps")
    began = time.perf_counter()
    if background is not None:
        background.wait("before the next save")  # one save in flight at a time
    root = Path(root).expanduser()
    io.check_plain(dict(state))
    fmt = _optimizer_format(cfg, optimizer)
    # Every rank waits for rank 0's outcome (a broadcast), so no rank writes before the folder exists.
    on_rank0("preparing the checkpoint folder", lambda: store.prepare_staging(root, step))

    fsdp = fsdp_ckpt.is_fsdp(model_chunks)  # [FSDP hook] Megatron-FSDP state: checkpoint_fsdp, fsdp_dtensor
    if fsdp:
        fmt = fsdp_ckpt.BACKEND if optimizer is not None else None
    else:
        metadata = io.sharded_metadata(fmt)
        sharded = io.model_state(model_chunks, metadata)
        if optimizer is not None:
            sharded["optimizer"] = io.optimizer_state(optimizer, dict(sharded), metadata, is_loading=False)
        if scheduler is not None:
            sharded["scheduler"] = scheduler.state_dict()
        sharded[io.RNG_KEY] = io.rng_object(io.capture_rng())
        sharded["state"] = dict(state)
        # what Megatron-LM's load_checkpoint reads first (args, checkpoint_version, iteration, its scheduler)
        sharded.update(foreign.common_keys(cfg, step, int(state.get("consumed_samples", 0)), fmt, optimizer is not None,
                                           sharded.get("scheduler")))
    if background is not None and not fsdp:
        meta = _meta(step, cfg, len(model_chunks), optimizer, scheduler, fmt, record)
        request = io.save_async(sharded, store.staging_dir(root, step), content_metadata=io.content_metadata(metadata))
        finish = lambda: _complete(root, step, meta, cfg, keep_last)  # noqa: E731
        background.schedule(request, step, root, io.state_bytes(sharded), began, finish)
        return store.iter_dir(root, step)  # complete once background.poll()/wait() says so
    try:
        if fsdp:  # [FSDP hook]
            fsdp_ckpt.save(model_chunks, optimizer, scheduler, state, store.staging_dir(root, step))
        else:
            io.save(sharded, store.staging_dir(root, step), content_metadata=io.content_metadata(metadata))
    except BaseException as exc:
        if not io.disk_full(exc):
            raise
        on_rank0("removing the partial checkpoint", lambda: store.clean_leftovers(root))
        last = store.latest(root)
        raise RecipeError(
            f"disk full at {store.staging_dir(root, step)}, the last complete checkpoint is "
            f"{last.name if last is not None else 'none (no checkpoint was completed yet)'}",
            fix="free space there (or lower checkpoint.keep_last) and start the run again: it resumes from that "
            "checkpoint; the partial folder has been removed",
        ) from None

    meta = _meta(step, cfg, len(model_chunks), optimizer, scheduler, fmt, record)
    if fsdp:  # [FSDP hook]
        meta["backend"] = fsdp_ckpt.BACKEND
    _complete(root, step, meta, cfg, keep_last)
    return store.iter_dir(root, step)


def _complete(root: Path, step: int, meta: Dict[str, Any], cfg: RunConfig, keep_last: int) -> None:
    """Collective, once every rank's shards are written: each file's size and hash into meta.json, then
    rank 0 publishes the checkpoint (``_finish``)."""
    collectives.barrier()  # every rank's files are on disk before any is listed
    meta[checksums.KEY] = checksums.record(store.staging_dir(root, step))
    on_rank0("finishing the checkpoint", lambda: _finish(root, step, meta, cfg, keep_last))


def weights_state(model_chunks: List[torch.nn.Module], state: Dict[str, Any], cfg: Optional[RunConfig] = None) -> Dict[str, Any]:
    """The sharded state dict ``save`` writes for weights only, without the per-rank RNG streams: what the HF
    importer streams tensor by tensor into ``prepare_staging(root, step)`` before ``finish_weights_only``.
    With ``cfg``, what Megatron-LM reads first too (an HF import is where Megatron-LM fine-tuning starts)."""
    metadata = io.sharded_metadata(None)
    sharded = io.model_state(model_chunks, metadata)
    sharded["state"] = dict(state)
    if cfg is not None:
        step = int(state.get("step", 0))
        sharded.update(foreign.common_keys(cfg, step, int(state.get("consumed_samples", 0)), None, False, None))
    sharded["content_metadata"] = io.content_metadata(metadata)  # where megatron-core's save puts it
    return sharded


def finish_weights_only(root: Path, step: int, cfg: RunConfig) -> Path:
    """Complete a weights-only checkpoint whose torch_dist files another writer put in
    ``prepare_staging(root, step)`` (the HF importer streams them without a process group):
    config.yaml, meta.json, rename, tracker, exactly as ``save`` finishes. One process."""
    meta = _meta(step, cfg, 1, None, None, None, None)
    meta["contents"]["rng"] = False
    meta[checksums.KEY] = checksums.record(store.staging_dir(Path(root), step))
    return _finish(Path(root), step, meta, cfg, keep_last=0)


# --- load ---


def verify_files(path: Path) -> bool:
    """Collective: True when every file of checkpoint ``path`` is as saved, False when it holds no record;
    a RecipeError naming the damaged files otherwise."""
    ckpt = Path(path)
    return checksums.verify(ckpt, store.read_meta(ckpt))


def _resolve_everywhere(path: Path) -> Path:
    """Rank 0 resolves (folder or checkpoints root -> complete folder) so all ranks load the same one."""
    return Path(on_rank0("finding the checkpoint", lambda: str(store.resolve_dir(Path(path)))))


def _check_before_tensors(sharded: Dict[str, Any], ckpt: Path) -> None:
    found = io.all_ranks(io.tensor_mismatches(sharded, ckpt))
    if found:
        raise RecipeError(
            f"checkpoint '{ckpt}' does not fit this model:\n    " + "\n    ".join(found),
            fix="load a checkpoint of this model (compare its config.yaml with the recipe)",
        )


def _read(sharded: Dict[str, Any], ckpt: Path) -> Dict[str, Any]:
    """megatron-core's load; a damaged file becomes a RecipeError (torch DCP raises on every rank)."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        return io.load_allowing_absent_extra_states(sharded, ckpt)
    except RecipeError:
        raise
    except (Exception, CheckpointException) as exc:
        raise io.unreadable(ckpt, exc)


def _trust(cfg: Optional[RunConfig]) -> bool:
    """``checkpoint.trust_code``: the user vouches for this checkpoint's pickled objects."""
    return bool(cfg is not None and cfg.checkpoint.trust_code)


def _say_foreign(ckpt: Path, meta: Dict[str, Any]) -> None:
    if torch.distributed.get_rank() == 0:
        print(foreign.summary(ckpt, meta), flush=True)


def _load_models(model_chunks: List[torch.nn.Module], loaded: Dict[str, Any]) -> None:
    models = io.unwrap(model_chunks)
    for key, model in zip(io.chunk_keys(len(models)), models):
        _adapters.load_model_state(model, loaded[key])  # strict; adapter-only for models with adapters


def load(
    path: Path,
    model_chunks: List[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    cfg: Optional[RunConfig] = None,
) -> Dict[str, Any]:
    """Restore a checkpoint (any layout of the same model) and return the loop's saved ``state``.

    ``path`` is an ``iter_NNNNNNN`` folder or a checkpoints root (its latest complete one is used). With
    ``cfg`` the model fingerprint is compared first and a checkpoint of another model is refused, naming
    the fields; without it, tensor names and shapes are still checked before anything is loaded. RNG
    streams are restored when the layout and world size are unchanged (a resharded resume cannot be
    bit-exact anyway); the returned state always carries ``step``.
    """
    _require_dist()
    ckpt = _resolve_everywhere(path)
    meta = store.read_meta(ckpt)
    store.require_readable_here(ckpt, meta)
    if cfg is not None:
        identity.check_same_model(meta, cfg, ckpt)
    checksums.verify(ckpt, meta)  # a damaged file is named before any tensor is read
    contents = meta.get("contents", {})
    if optimizer is not None and not contents.get("optimizer"):
        raise RecipeError(
            f"checkpoint '{ckpt}' holds weights only (no optimizer state), so training cannot resume from it",
            fix="start from its weights with checkpoint.pretrained=<path> and checkpoint.load=none",
        )
    if optimizer is not None and cfg is not None:
        identity.check_same_optimizer(contents, ckpt, cfg)
    if scheduler is not None and not contents.get("scheduler"):
        raise RecipeError(f"checkpoint '{ckpt}' has no LR scheduler state", fix="load it with checkpoint.pretrained")
    if meta.get("source"):
        if optimizer is not None:
            foreign.refuse_resume(ckpt)
        _say_foreign(ckpt, meta)
    saved_layout, now = meta.get("layout", {}), _runtime_layout(cfg)
    if fsdp_ckpt.is_fsdp(model_chunks) or fsdp_ckpt.is_fsdp_checkpoint(meta):  # [FSDP hook]
        return fsdp_ckpt.load(ckpt, meta, model_chunks, optimizer, scheduler, now, _trust(cfg))
    fmt = contents.get("optimizer_format") if optimizer is not None else None
    if optimizer is not None and "optimizer_format" in contents:
        _check_same_sharding(ckpt, fmt is not None, _is_distributed_optimizer(optimizer))
    if fmt == "dp_reshardable" and identity.model_parallel_changed(saved_layout, now):
        raise RecipeError(
            f"checkpoint '{ckpt}' stores its optimizer as dp_reshardable, which resumes only with the same "
            f"model-parallel layout ({', '.join(identity.model_parallel_changed(saved_layout, now))})",
            fix=f"resume with {identity.describe(saved_layout)}, or start from its weights with "
            "checkpoint.pretrained (the optimizer restarts); save with checkpoint.optimizer_format="
            "fully_reshardable to resume in any layout",
        )
    same_ranks = identity.same_ranks(saved_layout, now)
    if not same_ranks and optimizer is not None:
        formats.note_resharded_resume(identity.describe(saved_layout), identity.describe(now))
    if not same_ranks and torch.distributed.get_rank() == 0:
        log.warning(
            "resharding checkpoint %s from %s to %s; RNG streams start fresh",
            ckpt,
            identity.describe(saved_layout),
            identity.describe(now),
        )

    metadata = io.sharded_metadata(fmt)
    sharded = io.model_state(model_chunks, metadata)
    if optimizer is not None:
        sharded["optimizer"] = io.optimizer_state(optimizer, dict(sharded), metadata, is_loading=True)
    if same_ranks and contents.get("rng"):
        sharded[io.RNG_KEY] = io.rng_object()
    with restricted_loading(_trust(cfg)):
        _check_before_tensors(sharded, ckpt)
        loaded = _read(sharded, ckpt)
    _load_models(model_chunks, loaded)
    if optimizer is not None:
        saved_parts, parts_now = int(contents.get("optimizer_parts") or 1), io.optimizer_parts(optimizer)
        io.load_optimizer(optimizer, io.regroup_optimizer_state(loaded["optimizer"], saved_parts, parts_now))
    if meta.get("source"):  # Megatron-LM / Megatron-Bridge: its scheduler counts samples, its progress is its own
        scheduler_state, state = foreign.resume_parts(ckpt, loaded)
    else:
        scheduler_state, state = loaded.get("scheduler"), dict(loaded.get("state") or {})
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)
    if io.RNG_KEY in sharded:
        io.restore_rng(loaded[io.RNG_KEY])
    state.setdefault("step", meta.get("step"))
    return state


def load_weights(path: Path, model_chunks: List[torch.nn.Module], cfg: RunConfig) -> None:
    """Model weights only (fine-tuning from ``checkpoint.pretrained``, conversion round trips).

    Same resolution and fingerprint check as ``load``; a path that does not exist is an error,
    never a silent start from random weights.
    """
    _require_dist()
    ckpt = _resolve_everywhere(path)
    meta = store.read_meta(ckpt)
    store.require_readable_here(ckpt, meta)
    identity.check_same_model(meta, cfg, ckpt, weights_only=True)
    checksums.verify(ckpt, meta)
    if meta.get("source"):
        _say_foreign(ckpt, meta)
    unread = identity.unread_mtp_layers(meta, cfg)
    if unread and torch.distributed.get_rank() == 0:
        print(f"checkpoint '{ckpt}': its {unread} multi-token-prediction layer(s) are not loaded (model.mtp_num_layers "
              "is null here)", flush=True)
    if fsdp_ckpt.is_fsdp(model_chunks) or fsdp_ckpt.is_fsdp_checkpoint(meta):  # [FSDP hook]
        fsdp_ckpt.load_weights(ckpt, meta, model_chunks, _runtime_layout(cfg), _trust(cfg))
        return
    sharded = io.model_state(model_chunks, io.sharded_metadata(None))
    with restricted_loading(_trust(cfg)):
        _check_before_tensors(sharded, ckpt)
        loaded = _read(sharded, ckpt)
    _load_models(model_chunks, loaded)
