"""Models with adapters: their checkpoints hold the trainable tensors only (adapters, prefixes).

The frozen base comes from ``checkpoint.pretrained`` on every start, so checkpoints stay adapter-sized
(a QLoRA base is re-quantised from it, which is deterministic). The filter works on megatron-core's
``sharded_state_dict`` so keys, TP/PP/EP sharding and the gated-FC1 split are exactly what the full
model would store, and a checkpoint written at one layout resumes at another. Models without adapters
pass through unchanged (full fine-tuning and pretraining keep full checkpoints).

Adapter modules say what they are by subclassing ``AdapterModule``, so this package needs nothing from
``peft/`` (which sits above it and imports it).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron_recipes.config.errors import RecipeError


class AdapterModule:
    """Marks a module (LoRA linear, P-Tuning prefix) whose model's checkpoints hold trainable tensors only."""


def has_adapters(model: torch.nn.Module) -> bool:
    return any(isinstance(m, AdapterModule) for m in model.modules())


def _trainable(entry: Any) -> bool:
    data = getattr(entry, "data", None)
    return isinstance(data, torch.nn.Parameter) and data.requires_grad


def model_state(model: torch.nn.Module, metadata: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``model.sharded_state_dict``; for a model with adapters, only its trainable entries."""
    sharded = model.sharded_state_dict(metadata=metadata)
    if not has_adapters(model):
        return sharded
    return {key: entry for key, entry in sharded.items() if _trainable(entry)}


def load_model_state(model: torch.nn.Module, state: Dict[str, Any]) -> None:
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
