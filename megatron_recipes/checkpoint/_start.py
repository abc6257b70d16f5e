"""The trainer's side of checkpoints: what the loop stores in them and which one a run starts from.

The engine (``training/checkpoint.py``) writes and finds checkpoints, reshards them, and saves each
rank's RNG streams itself. This module adds the loop's counters to every save and decides the start:
``checkpoint.load`` (``auto`` = the latest complete checkpoint of this run, ``none``, or a path) wins;
otherwise ``checkpoint.pretrained`` weights; otherwise fresh initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.checkpoint import _save_load as checkpoint
from megatron_recipes.checkpoint import _files as store


def latest(cfg: RunConfig) -> Optional[Path]:
    """The latest complete checkpoint of this run, or None."""
    return checkpoint.find_latest(checkpoint.checkpoints_root(cfg))


def save(cfg: RunConfig, step: int, consumed_samples: int, model, optimizer, scheduler) -> Path:
    """A full checkpoint (weights, optimizer, scheduler, RNG, counters); ``consumed_samples`` is the whole
    data-iterator state, since the batch iterator is a pure function of it."""
    state = {"step": step, "consumed_samples": consumed_samples}
    return checkpoint.save_checkpoint(
        checkpoint.checkpoints_root(cfg), step, model, optimizer, scheduler, state, cfg, keep_last=cfg.checkpoint.keep_last
    )


def save_seed(cfg: RunConfig, model) -> Path:
    """A weights-only checkpoint of step 0 (``train.train_iters=0``): the starting point of any layout."""
    state = {"step": 0, "consumed_samples": 0}
    return checkpoint.save_checkpoint(
        checkpoint.checkpoints_root(cfg), 0, model, None, None, state, cfg, keep_last=cfg.checkpoint.keep_last
    )


def _is_seed(path: Path) -> bool:
    """A weights-only step-0 checkpoint, as ``train.train_iters=0`` writes."""
    meta = store.read_meta(path)
    return int(meta.get("step", -1)) == 0 and not meta.get("contents", {}).get("optimizer")


def resume(cfg: RunConfig, model, optimizer, scheduler) -> Optional[Dict[str, Any]]:
    """Load what the recipe asks for; the saved loop state when resuming, None on a fresh start.

    With ``checkpoint.load=auto``, a run whose only checkpoint is its own seed (``train.train_iters=0`` in
    the same run.dir) starts from the seed's weights, as ``checkpoint.pretrained`` would.
    """
    path = checkpoint.resolve_load(cfg)
    if path is not None and str(cfg.checkpoint.load).strip().lower() == "auto" and _is_seed(path):
        checkpoint.load_weights(path, model, cfg)
        if torch.distributed.get_rank() == 0:
            print(f"initial weights from this run's seed checkpoint {path}", flush=True)
        return None
    if path is not None:
        state = checkpoint.load_checkpoint(path, model, optimizer, scheduler, cfg=cfg)
        if torch.distributed.get_rank() == 0:
            print(f"resumed from {path} at step {state['step']}", flush=True)
        return state
    from megatron_recipes.peft.state import peft_active

    if cfg.checkpoint.pretrained and not peft_active(cfg) and not cfg.parallel.fsdp:  # those loaded it before wrapping
        # a missing path is an error there, never a silent random start
        checkpoint.load_weights(Path(cfg.checkpoint.pretrained), model, cfg)
        # The optimizer already holds its fp32 main copies (bf16/fp16, or the distributed optimizer's
        # shards) of the random initialisation: without this, its first step would write them back.
        optimizer.reload_model_params()
        if torch.distributed.get_rank() == 0:
            print(f"initial weights from {cfg.checkpoint.pretrained}", flush=True)
    return None


def load_pretrained_before_fsdp(cfg: RunConfig, chunks) -> None:
    """Megatron-FSDP: ``checkpoint.pretrained`` goes into the bare GPTModel chunks, before wrapping.

    Once wrapped, Megatron-FSDP owns the parameters in its own (sharded) buffers and offers only its
    fsdp_dtensor state dict, not the torch_dist one our checkpoints hold; before wrapping the chunks are
    plain megatron-core models, which load any layout of the checkpoint, and wrapping then shards them.
    """
    if not (cfg.parallel.fsdp and cfg.checkpoint.pretrained):
        return
    checkpoint.load_weights(Path(cfg.checkpoint.pretrained), chunks, cfg)
    if torch.distributed.get_rank() == 0:
        print(f"initial weights from {cfg.checkpoint.pretrained} (before Megatron-FSDP sharding)", flush=True)
