"""Rules on where tokens come from and how a run reports and saves itself."""

from __future__ import annotations

import math

from typing import Any, List, Optional

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import one_of, rule

DATA_KINDS = ("builtin", "indexed", "sft", "mock")
SPLITS = ("train", "valid", "test")


def _blend_problem(blend: List[Any], where: str) -> Optional[str]:
    """A blend is ``[prefix, ...]`` (equal weights) or ``[weight, prefix, weight, prefix, ...]``."""
    if not blend:
        return None
    if all(isinstance(x, str) for x in blend):
        return None
    if len(blend) % 2:
        return f"{where} has {len(blend)} entries: expected [weight, prefix, weight, prefix, ...] or [prefix, ...]"
    for i in range(0, len(blend), 2):
        weight, prefix = blend[i], blend[i + 1]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            return f"{where}[{i}]={weight!r} must be a positive weight"
        if not isinstance(prefix, str):
            return f"{where}[{i + 1}]={prefix!r} must be a dataset prefix (path without .bin/.idx)"
    return None


@rule("data.kind", ["data.kind"], "data.kind is builtin, indexed, sft or mock", "use data=builtin or data=indexed, ...")
def _kind(cfg: RunConfig) -> Optional[str]:
    return one_of(cfg.data.kind, DATA_KINDS, "data.kind")


@rule(
    "data.indexed_needs_blend",
    ["data.kind", "data.blend", "data.blend_per_split"],
    "indexed data names its datasets in data.blend or data.blend_per_split",
    "set data.blend=[/path/to/prefix_text_document] or data.blend=[0.7,/a_text_document,0.3,/b_text_document]",
    scope="input",
    needs="data.blend",
)
def _indexed_blend(cfg: RunConfig) -> Optional[str]:
    d = cfg.data
    if d.kind == "indexed" and not d.blend and not d.blend_per_split:
        return "data.kind=indexed but neither data.blend nor data.blend_per_split is set"
    return None


@rule(
    "data.blend_format",
    ["data.blend", "data.blend_per_split"],
    "blends are [prefix, ...] or [weight, prefix, ...]; per-split blends use train/valid/test; not both kinds",
    "write data.blend=[0.7,/data/a_text_document,0.3,/data/b_text_document]",
)
def _blend_format(cfg: RunConfig) -> Optional[str]:
    d = cfg.data
    if d.blend and d.blend_per_split:
        return "data.blend and data.blend_per_split are both set; keep one"
    problem = _blend_problem(list(d.blend), "data.blend")
    if problem or not d.blend_per_split:
        return problem
    unknown = sorted(set(d.blend_per_split) - set(SPLITS))
    if unknown:
        return f"data.blend_per_split has unknown split(s) {unknown}; use {list(SPLITS)}"
    if not d.blend_per_split.get("train"):
        return "data.blend_per_split has no 'train' blend"
    for split, blend in d.blend_per_split.items():
        problem = _blend_problem(list(blend), f"data.blend_per_split.{split}")
        if problem:
            return problem
    return None


@rule(
    "data.split",
    ["data.split"],
    "data.split is three finite non-negative train,valid,test weights with a positive train share",
    'use data.split="949,50,1"',
)
def _split(cfg: RunConfig) -> Optional[str]:
    parts = str(cfg.data.split).split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if len(values) == 3 and all(math.isfinite(v) for v in values) and min(values) >= 0 and values[0] > 0:
        return None
    return f'data.split="{cfg.data.split}" is not three comma-separated weights like "949,50,1"'


@rule(
    "data.sft_needs_path",
    ["data.kind", "data.sft_path", "data.overlong_policy"],
    "SFT data names its JSONL file (or builtin: the generated chat set); overlong_policy is truncate or drop",
    "set data.sft_path=/path/to/train.jsonl, or data.sft_path=builtin",
    scope="input",
    needs="data.sft_path",
)
def _sft(cfg: RunConfig) -> Optional[str]:
    d = cfg.data
    if d.kind != "sft":
        return None
    if not d.sft_path:
        return "data.kind=sft but data.sft_path is not set"
    return one_of(d.overlong_policy, ("truncate", "drop"), "data.overlong_policy")


def packed_thd_needs_mbs1(cfg: RunConfig) -> Optional[str]:
    """Transformer Engine takes packed rows as one THD sequence per micro-batch (shared with the
    machine check in models/capabilities.py, which applies it wherever the TE spec actually runs)."""
    d, t = cfg.data, cfg.train
    if d.kind == "sft" and d.packing and t.micro_batch_size != 1:
        return (
            f"data.packing=true with train.micro_batch_size={t.micro_batch_size}: Transformer Engine reads "
            "packed sequences in THD form, one packed row per micro-batch"
        )
    return None


@rule(
    "data.packing_micro_batch",
    ["data.kind", "data.packing", "train.micro_batch_size", "cluster.gpu_arch"],
    "on GPUs (Transformer Engine attention) packed SFT rows go one per micro-batch",
    "set train.micro_batch_size=1 (a packed row already holds several samples; raise train.seq_length "
    "to pack more), or data.packing=false",
)
def _packing_micro_batch(cfg: RunConfig) -> Optional[str]:
    if cfg.cluster.gpu_arch == "cpu":  # the CPU lane's local spec takes a block mask for any batch size
        return None
    return packed_thd_needs_mbs1(cfg)


@rule(
    "run.intervals",
    ["logging.log_interval", "logging.eval_interval", "logging.eval_iters", "checkpoint.save_interval", "checkpoint.keep_last"],
    "logging/eval/save intervals and keep_last are >= 1; eval_iters >= 0",
    "set positive intervals",
)
def _intervals(cfg: RunConfig) -> Optional[str]:
    lg, ck = cfg.logging, cfg.checkpoint
    values = {
        "logging.log_interval": lg.log_interval,
        "logging.eval_interval": lg.eval_interval,
        "checkpoint.save_interval": ck.save_interval,
        "checkpoint.keep_last": ck.keep_last,
    }
    bad = [f"{k}={v}" for k, v in values.items() if v < 1]
    if lg.eval_iters < 0:
        bad.append(f"logging.eval_iters={lg.eval_iters}")
    return f"{', '.join(bad)} out of range" if bad else None


DATA_RULES = [_kind, _indexed_blend, _blend_format, _split, _sft, _packing_micro_batch, _intervals]
