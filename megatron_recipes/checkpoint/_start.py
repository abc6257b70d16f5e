"""What a training run starts from, decided in one place: the checkpoint it resumes, the weights it loads first.

``start_of(cfg)`` decides once, the same on every rank:

- ``checkpoint.load`` (``auto`` = the latest complete checkpoint of this run, ``none``, or a path) names the
  checkpoint to resume: weights (or adapters), optimizer, scheduler, RNG streams, the loop's counters;
- the weights loaded first, into the bare GPTModel chunks before PEFT adapters and before DDP/Megatron-FSDP
  wrapping: the base (``checkpoint.pretrained``) of a run whose checkpoints hold adapters only, on every
  start; else ``checkpoint.pretrained`` when nothing is resumed; else this run's own seed
  (``train.train_iters=0`` in the same run.dir) when ``checkpoint.load=auto`` finds only that;
- otherwise fresh initialisation.

Loading into the bare chunks means the optimizer's fp32 main copies (bf16/fp16, the distributed optimizer's
shards) are built from the loaded weights, and Megatron-FSDP shards them when it wraps. TE's FP8 weights
keep their random init for the optimizer, so the trainer re-reads the main params after building it
(``reload_model_params``); Megatron-FSDP has no such re-read (rule fsdp.fp8_params_from_checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from megatron_recipes.checkpoint import _files as store
from megatron_recipes.checkpoint import _run_identity, _save_load
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig


def resolve_load(cfg: RunConfig) -> Optional[Path]:
    """What ``checkpoint.load`` asks to resume from: ``auto`` (latest complete under run.dir/checkpoints, or
    None), ``none``, or an explicit path that must hold a complete checkpoint. Same answer on every rank."""
    value = str(cfg.checkpoint.load).strip()
    if value.lower() == "none":
        return None

    def decide() -> Optional[str]:
        if value.lower() == "auto":
            found = store.latest(cfg)
            return str(found) if found is not None else None
        try:
            return str(store.resolve_dir(Path(value)))
        except RecipeError as exc:
            raise RecipeError(f"checkpoint.load={value}: {exc.message}", fix=exc.fix) from None

    if torch.distributed.is_initialized():
        found = _save_load.on_rank0("resolving checkpoint.load", decide)
    else:
        found = decide()
    return Path(found) if found is not None else None


def _is_seed(path: Path) -> bool:
    """A weights-only step-0 checkpoint, as ``train.train_iters=0`` writes."""
    meta = store.read_meta(path)
    return int(meta.get("step", -1)) == 0 and not meta.get("contents", {}).get("optimizer")


@dataclass(frozen=True)
class Start:
    """A run's start: ``weights`` go into the bare model first, ``resume`` restores everything after wrapping."""

    cfg: RunConfig
    resume_from: Optional[Path]
    weights: Optional[Path]
    note: str = ""  # the log line once the weights are in

    def check_identity(self, identity: Dict[str, Any]) -> None:
        """Before any tensor is read: the resumed checkpoint's record (tokenizer, PEFT and its base, data)
        must be this start's; the settings a segment may change are listed on rank 0."""
        if self.resume_from is None:
            return
        meta = store.read_meta(self.resume_from)
        _run_identity.check_resume(self.resume_from, meta, identity, self.cfg)
        if torch.distributed.get_rank() == 0:
            for line in _run_identity.notes(self.resume_from, meta, identity, self.cfg):
                print(line, flush=True)

    def load_weights(self, chunks: List[torch.nn.Module]) -> None:
        """Into the bare GPTModel chunks, before PEFT and wrapping; a missing path is an error, never a
        silent start from random weights."""
        if self.weights is None:
            return
        _save_load.load_weights(self.weights, chunks, self.cfg)
        if torch.distributed.get_rank() == 0:
            print(self.note, flush=True)

    def resume(self, model, optimizer, scheduler) -> Optional[Dict[str, Any]]:
        """Restore the checkpoint to resume (any layout); its saved loop state, or None on a fresh start."""
        if self.resume_from is None:
            return None
        state = _save_load.load(self.resume_from, model, optimizer, scheduler, cfg=self.cfg)
        if torch.distributed.get_rank() == 0:
            root = store.checkpoints_root(self.cfg)
            own = self.resume_from.resolve().parent == root.resolve()
            if own and store.record_resume(root, int(state["step"])):
                print(f"rewound to {self.resume_from} at step {state['step']}: the run continues from here (the "
                      f"tracker names it; retention keeps it); the later checkpoints in {root} are not resumed", flush=True)
            else:
                print(f"resumed from {self.resume_from} at step {state['step']}", flush=True)
        return state


def start_of(cfg: RunConfig, adapters_only: bool) -> Start:
    """Decide what ``cfg`` starts from (see the module docstring). ``adapters_only``: the run trains adapters
    on a frozen base (PEFT), so its checkpoints do not hold the base."""
    resume_from = resolve_load(cfg)
    pretrained = cfg.checkpoint.pretrained
    if adapters_only:
        if not pretrained:
            raise RecipeError(
                f"peft.method={cfg.peft.method} needs checkpoint.pretrained (the base the adapters train on)",
                fix="set checkpoint.pretrained=<converted checkpoint>",
            )
        return Start(cfg, resume_from, Path(pretrained), f"base weights from {pretrained}")
    if resume_from is not None:
        if str(cfg.checkpoint.load).strip().lower() == "auto" and _is_seed(resume_from):
            return Start(cfg, None, resume_from, f"initial weights from this run's seed checkpoint {resume_from}")
        return Start(cfg, resume_from, None)
    if pretrained:
        sharding = " (before Megatron-FSDP sharding)" if cfg.parallel.fsdp else ""
        return Start(cfg, None, Path(pretrained), f"initial weights from {pretrained}{sharding}")
    return Start(cfg, None, None)
