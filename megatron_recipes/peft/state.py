"""What a checkpoint of a PEFT run holds: the trainable tensors only (adapters, prefixes).

The frozen base comes from ``checkpoint.pretrained`` on every start, so checkpoints stay adapter-sized
(a QLoRA base is re-quantised from it, which is deterministic). The filter works on megatron-core's
``sharded_state_dict`` so keys, TP/PP/EP sharding and the gated-FC1 split are exactly what the full
model would store, and a checkpoint written at one layout resumes at another. Models without adapters
pass through unchanged (full fine-tuning and pretraining keep full checkpoints).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig


def has_adapters(model: torch.nn.Module) -> bool:
    from megatron_recipes.peft.lora import LoRALinear
    from megatron_recipes.peft.prefix import PrefixCoreAttention

    return any(isinstance(m, (LoRALinear, PrefixCoreAttention)) for m in model.modules())


def _trainable(entry: Any) -> bool:
    data = getattr(entry, "data", None)
    return isinstance(data, torch.nn.Parameter) and data.requires_grad


def checkpoint_state(model: torch.nn.Module, metadata: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``model.sharded_state_dict``; for a model with adapters, only its trainable entries."""
    sharded = model.sharded_state_dict(metadata=metadata)
    if not has_adapters(model):
        return sharded
    return {key: entry for key, entry in sharded.items() if _trainable(entry)}


def load_state(model: torch.nn.Module, state: Dict[str, Any]) -> None:
    """``load_state_dict``; for a model with adapters every trainable tensor must be in ``state``."""
    if not has_adapters(model):
        model.load_state_dict(state, strict=True)
        return
    result = model.load_state_dict(state, strict=False)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(k for k in result.missing_keys if k in trainable)
    if missing or result.unexpected_keys:
        raise RecipeError(
            f"adapter checkpoint does not match this model's adapters: missing {missing[:6]}, "
            f"unexpected {list(result.unexpected_keys)[:6]}",
            fix="resume with the peft.* settings the checkpoint was written with (see its config.yaml)",
        )


def prepare_for_training(cfg: RunConfig, chunks) -> Optional["object"]:
    """For a PEFT recipe: load ``checkpoint.pretrained`` into the bare chunks, then ``apply_peft``.

    Returns the ``PeftSummary`` (None for ``peft.method=none``, where the trainer loads pretrained weights
    itself when no checkpoint is resumed). The base is loaded on every start, resumed or not, because
    PEFT checkpoints do not hold it.
    """
    from pathlib import Path

    from megatron_recipes.peft import apply_peft, methods
    from megatron_recipes.checkpoint import _save_load as checkpoint

    if methods.parse(cfg.peft.method).none:
        return None
    if not cfg.checkpoint.pretrained:
        raise RecipeError(
            f"peft.method={cfg.peft.method} needs checkpoint.pretrained (the base the adapters train on)",
            fix="set checkpoint.pretrained=<converted checkpoint>",
        )
    checkpoint.load_weights(Path(cfg.checkpoint.pretrained), chunks, cfg)
    if torch.distributed.get_rank() == 0:
        print(f"base weights from {cfg.checkpoint.pretrained}", flush=True)
    return apply_peft(chunks, cfg)


def peft_active(cfg: RunConfig) -> bool:
    from megatron_recipes.peft import methods

    return not methods.why_not(cfg.peft.method) and not methods.parse(cfg.peft.method).none
