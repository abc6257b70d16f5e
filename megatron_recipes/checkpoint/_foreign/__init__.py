"""Checkpoints written by Megatron-LM or Megatron-Bridge, read as if they were ours.

Why here, behind ``_files.read_meta``/``read_run``: every reader of a checkpoint (training's
``checkpoint.pretrained`` and ``checkpoint.load``, ``convert export``/``verify``, ``generate``, ``eval``,
``serve``) asks those two for what a folder holds. A foreign folder has no ``meta.json``/``config.yaml``;
this package describes it from the checkpoint's own record (Megatron-LM's ``args``, Megatron-Bridge's
``run_config.yaml``) in the same terms, so the same fingerprint and layout checks refuse what does not
fit, and the same megatron-core load reads its tensors (both tools save ``model.sharded_state_dict()``
under the keys we use). What differs on resume (scheduler units, where the loop's progress lives) is
``resume_parts``; the RNG streams are never taken (Megatron-LM keeps a (pp, tp) grid, we keep one per rank).

Everything is read under ``restricted_loading``: a Megatron-LM ``common.pt`` may hold an
``argparse.Namespace`` and the enums its arguments use, nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Tuple

from megatron_recipes.checkpoint._foreign import megatron_bridge as bridge
from megatron_recipes.checkpoint._foreign import megatron_lm as mlm
from megatron_recipes.config.errors import RecipeError

MEGATRON_LM = "megatron-lm"
MEGATRON_BRIDGE = "megatron-bridge"
_OURS = "meta.json"  # _files.META (_files imports this package)
_MCORE_CONFIG = "metadata.json"  # megatron-core's record of the sharded backend
_DCP_INDEX = ".metadata"
_COMMON_PT = "common.pt"
BASE_RECIPE = "tiny_llama_cpu"  # the settings a foreign checkpoint's run description takes beyond model and layout


def kind(ckpt_dir: Path) -> Optional[str]:
    """Which tool wrote ``ckpt_dir`` (None: ours, or not a checkpoint). Reads no file: imports no torch."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / _OURS).exists() or not (ckpt_dir / _MCORE_CONFIG).is_file():
        return None
    return MEGATRON_BRIDGE if (ckpt_dir / bridge.RUN_CONFIG).is_file() else MEGATRON_LM


def complete(ckpt_dir: Path) -> bool:
    """megatron-core writes its index and config last; up to 0.18 also common.pt."""
    ckpt_dir = Path(ckpt_dir)
    return (ckpt_dir / _DCP_INDEX).is_file() and (ckpt_dir / _MCORE_CONFIG).is_file()


class Described(NamedTuple):
    source: str
    args: Any  # Megatron-LM's args (Bridge's run_config.yaml in its terms)
    common: Dict[str, Any]  # the common state, tensors aside
    model: Any  # ModelConfig
    layout: Dict[str, Any]
    step: int
    consumed_samples: Optional[int]


def _common_state(ckpt_dir: Path) -> Dict[str, Any]:
    from megatron.core import dist_checkpointing

    from megatron_recipes.checkpoint._trust import restricted_loading, trusted

    try:
        with restricted_loading(trusted()):
            return dict(dist_checkpointing.load_common_state_dict(str(ckpt_dir)))
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 (a damaged or partial folder: say which)
        raise RecipeError(f"'{ckpt_dir}' looks like a megatron-core checkpoint, but its common state cannot be read: "
                          f"{type(exc).__name__}: {exc}", fix="point at a complete checkpoint folder") from None


def _model_config(fields: Dict[str, Any], name: str, family: str):
    from megatron_recipes.config.schema import ModelConfig, RopeScalingConfig

    values = dict(fields)
    if values.get("rope_scaling") is not None:
        values["rope_scaling"] = RopeScalingConfig(**values["rope_scaling"])
    return ModelConfig(name=name, family=family, **values)


@functools.lru_cache(maxsize=32)
def _describe(path: str, stamp: float) -> Described:  # noqa: ARG001 (stamp: a rewritten folder is read again)
    ckpt_dir = Path(path)
    source = kind(ckpt_dir)
    common = _common_state(ckpt_dir)
    if source == MEGATRON_BRIDGE:
        args = bridge.as_args(bridge.read(ckpt_dir), path)
        step, consumed = bridge.progress(ckpt_dir, common)
    else:
        args = common.get("args")
        if args is None or not hasattr(args, "num_layers"):
            raise RecipeError(
                f"'{ckpt_dir}' is a megatron-core checkpoint without a model description (no meta.json, no "
                "Megatron-LM args in its common state, no Megatron-Bridge run_config.yaml)",
                fix="point at a checkpoint written by megatron-recipes, Megatron-LM or Megatron-Bridge")
        step, consumed = mlm.progress(args, common)
    fields = mlm.model_fields(args, path)
    family = mlm.family_of(fields)
    model = _model_config(fields, f"{source}:{ckpt_dir.parent.name or ckpt_dir.name}", family)
    plain = {k: v for k, v in common.items() if k in ("iteration", "checkpoint_version", "content_metadata", "optimizer",
                                                      "opt_param_scheduler")}
    return Described(source, args, plain, model, mlm.layout(args), step, consumed)


def describe(ckpt_dir: Path) -> Described:
    ckpt_dir = Path(ckpt_dir).resolve()
    return _describe(str(ckpt_dir), (ckpt_dir / _MCORE_CONFIG).stat().st_mtime)


def meta(ckpt_dir: Path, fmt: str, version: int) -> Dict[str, Any]:
    """A ``meta.json`` for a foreign checkpoint, in our terms (``fmt``/``version``: _files.FORMAT and its
    version), so the same checks read it."""
    from megatron_recipes.checkpoint import _identity

    d = describe(ckpt_dir)
    args = d.args
    content = d.common.get("content_metadata") or {}
    fingerprint = _identity.fingerprint_of(d.model)
    if mlm.vocab_size(args) is None:  # only the padded rows are known: those are checked (layout), not the size
        fingerprint.pop("vocab_size")
    has_optimizer = "optimizer" in d.common and not getattr(args, "no_save_optim", False)
    distributed = bool(getattr(args, "use_distributed_optimizer", False))
    return {
        "format": fmt,
        "format_version": version,
        "complete": True,
        "source": d.source,
        "step": d.step,
        "run_name": d.model.name,
        "fingerprint": fingerprint,
        "layout": d.layout,
        "family_inferred": d.model.family,
        "contents": {
            "model_chunks": int(d.layout.get("vpp") or 1),
            "optimizer": has_optimizer,
            "optimizer_class": None,
            "optimizer_name": getattr(args, "optimizer", None) if has_optimizer else None,
            "optimizer_format": (content.get("distrib_optim_sharding_type") or "dp_reshardable") if has_optimizer and distributed else None,
            "optimizer_parts": 2 if d.model.num_moe_experts else 1,
            "scheduler": "opt_param_scheduler" in d.common,
            "rng": False,
        },
        "backend": "torch_dist",
        "megatron_core_version": "0.16" if (Path(ckpt_dir) / _COMMON_PT).is_file() else "0.19",
    }


def run_config(ckpt_dir: Path):
    """The run a foreign checkpoint describes: its model and layout, this project's defaults for the rest."""
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.config.schema import ParallelConfig

    d = describe(ckpt_dir)
    lay, args = d.layout, d.args
    base = compose_recipe(BASE_RECIPE)
    parallel = dataclasses.replace(
        ParallelConfig(), tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"], cp=lay["cp"], ep=lay["ep"], sp=lay["sp"],
        etp=lay["etp"] if lay["etp"] != lay["tp"] else None,
        num_layers_in_first_pipeline_stage=lay["num_layers_in_first_pipeline_stage"],
        num_layers_in_last_pipeline_stage=lay["num_layers_in_last_pipeline_stage"],
        account_for_embedding_in_pipeline_split=lay["account_for_embedding_in_pipeline_split"],
        account_for_loss_in_pipeline_split=lay["account_for_loss_in_pipeline_split"], pipeline_layout=lay["pipeline_layout"])
    dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    precision = dataclasses.replace(base.precision, name=dtype, params_dtype=dtype)
    train = dataclasses.replace(base.train, **{k: int(getattr(args, a)) for k, a in (
        ("global_batch_size", "global_batch_size"), ("micro_batch_size", "micro_batch_size"), ("seq_length", "seq_length"))
        if getattr(args, a, None)})
    tokenizer = getattr(args, "tokenizer_model", None)
    data = dataclasses.replace(base.data, tokenizer=str(tokenizer)) if tokenizer and Path(str(tokenizer)).is_dir() else base.data
    run = dataclasses.replace(base.run, name=d.model.name)
    return dataclasses.replace(base, model=d.model, parallel=parallel, precision=precision, train=train, data=data, run=run)


def resume_parts(ckpt_dir: Path, loaded: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], Dict[str, Any]]:
    """(scheduler state in our units, the loop's state) of a resumed foreign checkpoint."""
    d = describe(ckpt_dir)
    scheduler = loaded.get("opt_param_scheduler")
    if scheduler is not None:
        scheduler = mlm.scheduler_in_steps(scheduler, d.args, str(ckpt_dir))
    state: Dict[str, Any] = {"step": d.step}
    if d.consumed_samples is not None:
        state["consumed_samples"] = int(d.consumed_samples)
    return scheduler, state


def refuse_resume(ckpt_dir: Path) -> None:
    """What a resume of a foreign checkpoint cannot continue, named before any tensor is read."""
    mlm.scheduler_in_steps({}, describe(ckpt_dir).args, str(ckpt_dir))  # refuses a ramped batch size


def summary(ckpt_dir: Path, meta: Dict[str, Any]) -> str:
    """The log line of a foreign checkpoint being read: what was inferred, what is not taken."""
    record = "its run_config.yaml" if meta["source"] == MEGATRON_BRIDGE else "its args"
    vocab = "" if "vocab_size" in meta["fingerprint"] else f", vocabulary of {meta['layout'].get('padded_vocab_size')} rows"
    return (f"{ckpt_dir} is a {meta['source']} checkpoint (step {meta['step']}): model described by {record} "
            f"(family {meta.get('family_inferred')} inferred{vocab}); its RNG streams are not taken")


common_keys = mlm.common_keys  # what Megatron-LM's load_checkpoint needs in our common state
