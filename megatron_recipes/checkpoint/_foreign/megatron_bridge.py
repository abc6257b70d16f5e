"""Megatron-Bridge checkpoints: the model is described by ``run_config.yaml`` in each ``iter_NNNNNNN``
folder (its ``ConfigContainer``: ``model`` holds megatron-core ``TransformerConfig`` names), the loop's
progress by ``train_state.pt``; the tensors are megatron-core's torch_dist files, as Megatron-LM writes them.

Why translate into Megatron-LM's argument names: one mapping (``megatron_lm.model_fields``) then decides,
and refuses, for both tools.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from megatron_recipes.config.errors import RecipeError

RUN_CONFIG = "run_config.yaml"
TRAIN_STATE = "train_state.pt"

# TransformerConfig name -> Megatron-LM argument name, where they differ
_RENAMED = {"num_moe_experts": "num_experts", "layernorm_epsilon": "norm_epsilon"}
_ACTIVATIONS = {"silu": "swiglu", "squared_relu": "squared_relu", "gelu": None}


def read(ckpt_dir: Path) -> Dict[str, Any]:
    """``run_config.yaml`` as plain data (YAML's safe loader: no object is built from it)."""
    import yaml

    path = Path(ckpt_dir) / RUN_CONFIG
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"'{path}' cannot be read: {exc}", fix="the Megatron-Bridge checkpoint is damaged; use another one") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise RecipeError(f"'{path}' has no 'model' section", fix="point at a Megatron-Bridge iter_NNNNNNN folder")
    return data


def _activation(model: Dict[str, Any]) -> Dict[str, bool]:
    target = model.get("activation_func")
    name = str(target.get("_target_", "") if isinstance(target, dict) else target or "gelu").rsplit(".", 1)[-1]
    gated = bool(model.get("gated_linear_unit"))
    if name == "silu" and gated:
        return {"swiglu": True}
    if name == "squared_relu" and not gated:
        return {"squared_relu": True}
    if name == "gelu" and not gated:
        return {}
    return {"gated_linear_unit": True} if gated else {"quick_geglu": True}  # refused by the mapping, named


def as_args(run_config: Dict[str, Any], where: str) -> argparse.Namespace:
    """``run_config.yaml`` in Megatron-LM's ``args`` terms (only what the mapping reads)."""
    from megatron_recipes.config import derived
    model, train = run_config["model"], run_config.get("train") or {}
    optimizer = run_config.get("optimizer") or {}
    values = {_RENAMED.get(k, k): v for k, v in model.items() if not isinstance(v, dict) or k == "window_size"}
    values.update(_activation(model))
    values["group_query_attention"] = model.get("num_query_groups") not in (None, model.get("num_attention_heads"))
    values["untie_embeddings_and_output_weights"] = not model.get("share_embeddings_and_output_weights", True)
    values.setdefault("max_position_embeddings", model.get("seq_length"))
    if values.get("num_query_groups") is None:
        values["num_query_groups"] = model.get("num_attention_heads")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size"):
        if model.get(key) is None:
            raise RecipeError(f"'{where}/{RUN_CONFIG}' has no model.{key}", fix="point at a complete Megatron-Bridge checkpoint")
    vocab, tp = int(model["vocab_size"]), int(model.get("tensor_model_parallel_size") or 1)
    values["padded_vocab_size"] = (derived.padded_rows(vocab, int(model.get("make_vocab_size_divisible_by") or 128), tp)
                                   if model.get("should_pad_vocab", True) else vocab)
    values["global_batch_size"] = train.get("global_batch_size")
    values["rampup_batch_size"] = train.get("rampup_batch_size")
    values["use_distributed_optimizer"] = bool(optimizer.get("use_distributed_optimizer", False))
    values["optimizer"] = optimizer.get("optimizer", "adam")
    return argparse.Namespace(**values)


def progress(ckpt_dir: Path, common: Dict[str, Any]) -> Tuple[int, Optional[int]]:
    """(step, consumed samples) from ``train_state.pt`` (tensors and plain values: a weights-only load)."""
    import torch

    path = Path(ckpt_dir) / TRAIN_STATE
    if not path.is_file():
        return int(common.get("iteration", 0)), None
    state = torch.load(path, map_location="cpu", weights_only=True)
    plain = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    return int(plain.get("step", common.get("iteration", 0))), plain.get("consumed_train_samples")
