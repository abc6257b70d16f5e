"""What a checkpoint is *of*: the model's fingerprint and the parallel layout it was saved with.

Why: a checkpoint of another model must be refused before a single tensor is read, naming the fields that
differ (loading by tensor shapes alone fails late inside megatron-core, or succeeds on a look-alike model
with different norms or RoPE and gives silently wrong logits). A checkpoint of the *same* model saved in
another layout must load: resharding across TP/PP/VPP/DP/EP is what distributed checkpoints are for, so
the layout is recorded for information and for the few things that do depend on it (RNG streams, the
optimizer format that only reshards along DP, the padded vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List

from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

CONFIG_NAME = "config.yaml"  # _files.CONFIG (_files imports nothing from here)

# Labels, not architecture: the same weights may be published under another name or family.
_LABELS = {"name", "family"}
# Settings that shape training or initialisation but not the weights a checkpoint holds.
# (make_vocab_size_divisible_by matters only through the padded row count, checked with the layout.)
_NOT_WEIGHTS = {"init_method_std", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
                "make_vocab_size_divisible_by", "mtp_loss_scaling_factor"}
# The layout fields whose change needs tensors resharded (DP alone only moves optimizer shards).
MODEL_PARALLEL_FIELDS = (
    "tp",
    "pp",
    "vpp",
    "cp",
    "ep",
    "etp",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_layout",
)


def _plain(value: Any) -> Any:
    """JSON round trip, so a fingerprint read back from meta.json compares equal to a fresh one."""
    return json.loads(json.dumps(value, sort_keys=True))


def model_fingerprint(cfg: RunConfig) -> Dict[str, Any]:
    """The architecture fields of ``cfg.model``: equal fingerprints mean interchangeable weights."""
    return fingerprint_of(cfg.model)


def fingerprint_of(model) -> Dict[str, Any]:
    """``model_fingerprint`` of a ``ModelConfig`` alone (a foreign checkpoint's, described from its own record)."""
    fields = dataclasses.asdict(model)
    for key in _LABELS | _NOT_WEIGHTS:
        fields.pop(key, None)
    if fields.get("position_embedding_type") != "learned_absolute":
        fields.pop("max_position_embeddings", None)  # RoPE models hold no per-position weights
    return _plain(fields)


def layout(cfg: RunConfig) -> Dict[str, Any]:
    """The parallel layout of a run, with the quantities derived from it that shape tensors."""
    p = cfg.parallel
    return _plain(
        {
            "tp": p.tp,
            "pp": p.pp,
            "vpp": p.vpp,
            "cp": p.cp,
            "ep": p.ep,
            "etp": derived.expert_tensor_parallel_size(cfg),
            "sp": p.sp,
            "dp": derived.data_parallel_size(cfg),
            "world_size": derived.world_size(cfg),
            "num_layers_in_first_pipeline_stage": p.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": p.num_layers_in_last_pipeline_stage,
            "account_for_embedding_in_pipeline_split": p.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": p.account_for_loss_in_pipeline_split,
            "pipeline_layout": p.pipeline_layout,
            "make_vocab_size_divisible_by": cfg.model.make_vocab_size_divisible_by,
            "padded_vocab_size": derived.padded_vocab_size(cfg.model, p.tp),
        }
    )


def describe(lay: Dict[str, Any]) -> str:
    parts = [f"TP={lay.get('tp')}", f"PP={lay.get('pp')}"]
    if lay.get("vpp"):
        parts.append(f"VPP={lay['vpp']}")
    parts += [f"CP={lay.get('cp')}", f"EP={lay.get('ep')}", f"DP={lay.get('dp')}"]
    return " ".join(parts)


def differences(saved: Dict[str, Any], current: Dict[str, Any], prefix: str = "model.") -> List[str]:
    """``field: checkpoint X, recipe Y`` for every field both sides know and that differs."""
    out = []
    for key in sorted(set(saved) & set(current)):
        if saved[key] != current[key]:
            out.append(f"{prefix}{key}: checkpoint {saved[key]!r}, recipe {current[key]!r}")
    return out


def check_same_model(meta: Dict[str, Any], cfg: RunConfig, path: Any, weights_only: bool = False) -> None:
    """RecipeError naming every differing architecture field, before any tensor is touched.

    ``weights_only``: a model built without multi-token-prediction layers (a training head: generation and
    logits need none) may load the weights of the same model trained with them; theirs stay unread."""
    saved = meta.get("fingerprint")
    if not isinstance(saved, dict):
        raise RecipeError(f"checkpoint '{path}' has no model fingerprint in its meta.json", fix="use an intact checkpoint")
    diffs = differences(saved, model_fingerprint(cfg))
    if weights_only and unread_mtp_layers(meta, cfg):
        diffs = [d for d in diffs if not d.startswith("model.mtp_num_layers:")]
    if diffs:
        raise RecipeError(
            f"checkpoint '{path}' holds a different model than the recipe ({len(diffs)} field(s) differ):\n    "
            + "\n    ".join(diffs),
            fix=f"load a checkpoint of this model, or set the recipe's model to the checkpoint's "
            f"(its resolved recipe is {path}/config.yaml)",
        )
    _check_padded_vocab(meta.get("layout") or {}, cfg, path)


def unread_mtp_layers(meta: Dict[str, Any], cfg: RunConfig) -> int:
    """MTP layers the checkpoint holds and a model built without them leaves unread."""
    saved = (meta.get("fingerprint") or {}).get("mtp_num_layers") or 0
    return int(saved) if not cfg.model.mtp_num_layers else 0


def _check_padded_vocab(saved: Dict[str, Any], cfg: RunConfig, path: Any) -> None:
    """megatron pads the embedding to a multiple of make_vocab_size_divisible_by * TP, so TP moves the pad."""
    rows = saved.get("padded_vocab_size")
    now = derived.padded_vocab_size(cfg.model, cfg.parallel.tp)
    if rows is None or rows == now:
        return
    multiple = int(saved.get("make_vocab_size_divisible_by", 1)) * int(saved.get("tp", 1))
    suggestion = (
        f"set model.make_vocab_size_divisible_by={multiple // cfg.parallel.tp} so TP={cfg.parallel.tp} pads to "
        f"{rows} rows like the checkpoint"
        if multiple % cfg.parallel.tp == 0
        else "use a TP whose padding gives the checkpoint's row count"
    )
    raise RecipeError(
        f"checkpoint '{path}' has {rows} embedding rows (vocab_size={cfg.model.vocab_size} padded to a multiple "
        f"of make_vocab_size_divisible_by x TP = {multiple}); this layout pads to {now} rows",
        fix=suggestion,
    )


def model_parallel_changed(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """``field: saved -> now`` for each model-parallel field ``current`` knows that differs."""
    keys = [key for key in MODEL_PARALLEL_FIELDS if key in current]
    # unset (None) and off (False) mean the same; checkpoints saved before a field existed lack it
    return [f"{key}: {saved.get(key)} -> {current[key]}" for key in keys if (saved.get(key) or None) != (current[key] or None)]


def same_ranks(saved: Dict[str, Any], current: Dict[str, Any]) -> bool:
    """Same layout on the same number of ranks: each rank's saved RNG streams belong to the same rank now."""
    return not model_parallel_changed(saved, current) and saved.get("dp") == current.get("dp") and saved.get(
        "world_size"
    ) == current.get("world_size")


def check_same_optimizer(contents: Dict[str, Any], ckpt: Path, cfg: RunConfig) -> None:
    """Adam moments cannot become SGD momentum (nor the reverse): say so instead of megatron-core's traceback."""
    saved = contents.get("optimizer_name")
    if saved is None:  # checkpoints from before meta.json recorded it: their config.yaml says it
        try:
            from omegaconf import OmegaConf

            saved = OmegaConf.select(OmegaConf.load(str(ckpt / CONFIG_NAME)), "optimizer.name")
        except Exception:  # noqa: BLE001 (no readable config: the load's own checks speak)
            return
    if saved and saved != cfg.optimizer.name:
        raise RecipeError(
            f"checkpoint '{ckpt}' holds {saved} optimizer state, but this run uses optimizer.name="
            f"{cfg.optimizer.name}; one cannot be resumed as the other",
            fix=f"resume with optimizer={saved}, or start from its weights with checkpoint.pretrained={ckpt} "
            "checkpoint.load=none (the optimizer and LR schedule then start fresh)",
        )
