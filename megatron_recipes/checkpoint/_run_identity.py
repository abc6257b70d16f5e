"""What a resume must match beyond the architecture, and what it may change with a line in the log.

Why: a resume that loads cleanly can still continue a different run: adapters put over another base (a
recipe whose ``checkpoint.pretrained`` names a checkpoints root picks up a newer base whenever the base run
goes on), a changed LoRA alpha (the adapters' scale), another tokenizer (every id names another token),
other data (``consumed_samples`` then indexes other samples). Each trained on silently with a loss jump
nobody explained. A checkpoint records these in ``meta.json`` (``run_identity``); a resume compares them
and refuses a difference naming the field. What may change between segments of one run (the layout, the
learning rate, the length, logging) is accepted and listed, so the log says what the new segment runs with.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from megatron_recipes.checkpoint import _files as store
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

KEY = "run_identity"  # in meta.json
# PEFT settings that do not change what the adapters compute: dropout only acts while training, the NF4
# backend is the same arithmetic on another library
_PEFT_FREE = {"dropout", "nf4_backend"}
# Recipe groups a resume may change, listed in the log; model is the fingerprint's, peft/data are identity
_LISTED = ("parallel", "precision", "optimizer", "train", "checkpoint", "logging", "fusions", "seed", "cluster")


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True))


def base_identity(cfg: RunConfig) -> Optional[Dict[str, Any]]:
    """The exact checkpoint a PEFT run's ``checkpoint.pretrained`` resolves to now (step, run, save time)."""
    if not cfg.checkpoint.pretrained:
        return None
    resolved = store.resolve_dir(Path(cfg.checkpoint.pretrained))
    meta = store.read_meta(resolved)
    return {"path": str(resolved), "step": meta.get("step"), "run_name": meta.get("run_name"),
            "saved_at": meta.get("saved_at")}


def run_identity(cfg: RunConfig, tokenizer_sha: Optional[str], data: Dict[str, Any], adapters_only: bool) -> Dict[str, Any]:
    """The record a checkpoint of ``cfg`` carries (built once per start, stored by every save)."""
    peft = {k: v for k, v in dataclasses.asdict(cfg.peft).items() if k not in _PEFT_FREE}
    return _plain({
        "tokenizer_sha": tokenizer_sha,
        "peft": peft,
        "base": base_identity(cfg) if adapters_only else None,
        "data": data,
    })


def _base_problem(saved: Dict[str, Any], now: Optional[Dict[str, Any]]) -> Optional[str]:
    same = now is not None and all(saved.get(k) == now.get(k) for k in ("step", "run_name", "saved_at"))
    if same:
        return None
    where = f"{now['path']} (step {now['step']})" if now else "nothing"
    return (f"checkpoint.pretrained: the adapters were trained on the base {saved.get('path')} (step "
            f"{saved.get('step')}), it now resolves to {where}")


def problems(saved: Dict[str, Any], now: Dict[str, Any], accept_new_data: bool) -> List[str]:
    """One line per identity field that differs (fields a record lacks are not compared: older saves)."""
    out = []
    if saved.get("tokenizer_sha") and now.get("tokenizer_sha") and saved["tokenizer_sha"] != now["tokenizer_sha"]:
        out.append(f"data.tokenizer: another tokenizer (content hash {saved['tokenizer_sha']} in the checkpoint, "
                   f"{now['tokenizer_sha']} now): every token id would mean another token")
    for key in sorted(set(saved.get("peft") or {}) & set(now.get("peft") or {})):
        if saved["peft"][key] != now["peft"][key]:
            out.append(f"peft.{key}: checkpoint {saved['peft'][key]!r}, recipe {now['peft'][key]!r}")
    if saved.get("base"):
        problem = _base_problem(saved["base"], now.get("base"))
        if problem:
            out.append(problem)
    if not accept_new_data and saved.get("data") and now.get("data"):
        for key in sorted(set(saved["data"]) & set(now["data"])):
            if saved["data"][key] != now["data"][key]:
                out.append(f"data ({key}): the checkpoint's data position counts samples of other data "
                           f"({_short(saved['data'][key])} then, {_short(now['data'][key])} now)")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_resume(ckpt: Path, meta: Dict[str, Any], now: Dict[str, Any], cfg: RunConfig) -> None:
    """Refuse a resume of ``ckpt`` whose recorded identity differs from this start's, naming each field."""
    saved = meta.get(KEY)
    if not isinstance(saved, dict):
        return  # saved before checkpoints recorded it
    found = problems(saved, now, cfg.checkpoint.accept_new_data)
    if not found:
        return
    fix = (f"resume with the settings the checkpoint was trained with (its recipe: {ckpt}/{store.CONFIG}); to "
           "train with the new ones, start a new run from its weights: run.dir=<new folder> "
           f"checkpoint.pretrained={ckpt} checkpoint.load=none")
    if saved.get("base") and any(p.startswith("checkpoint.pretrained") for p in found):
        fix = f"set checkpoint.pretrained={saved['base'].get('path')} (the exact base the adapters were trained on)"
    if any(p.startswith("data (") for p in found):
        fix += "; for a new data phase that keeps the optimizer state, set checkpoint.accept_new_data=true"
    raise RecipeError(
        f"checkpoint '{ckpt}' cannot be resumed by this recipe without changing what the run trains "
        f"({len(found)} difference(s)):\n    " + "\n    ".join(found),
        fix=fix,
    )


def _flat(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, dict):
        out: Dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def changed_settings(ckpt: Path, cfg: RunConfig) -> List[str]:
    """``key: then -> now`` for the settings a resume may change (the checkpoint's config.yaml against now)."""
    from omegaconf import OmegaConf

    from megatron_recipes.config.compose import to_yaml

    path = ckpt / store.CONFIG
    try:
        then = _flat(OmegaConf.to_container(OmegaConf.load(str(path)), resolve=False))
    except Exception:  # noqa: BLE001 (a checkpoint without a readable config.yaml: nothing to list)
        return []
    now = _flat(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)), resolve=False))
    skip = ("checkpoint.load", "checkpoint.pretrained")
    keys = [k for k in sorted(set(then) | set(now)) if k.split(".")[0] in _LISTED and k not in skip]
    return [f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in keys if then.get(k) != now.get(k)]


def notes(ckpt: Path, meta: Dict[str, Any], now: Dict[str, Any], cfg: RunConfig) -> Tuple[str, ...]:
    """The log lines of an accepted resume: the settings it changes, and a new data phase when accepted."""
    out = []
    changes = changed_settings(ckpt, cfg)
    if changes:
        out.append(f"resuming with {len(changes)} changed setting(s) (safe to change between segments): "
                   + "; ".join(changes))
    saved = meta.get(KEY)
    if cfg.checkpoint.accept_new_data and isinstance(saved, dict) and problems(saved, now, accept_new_data=False):
        out.append("checkpoint.accept_new_data=true: this segment trains on other data than the checkpoint's; "
                   "the optimizer state and the sample count carry over")
    return tuple(out)
