"""Pretraining datasets through megatron-core: ``GPTDatasetConfig`` + ``BlendedMegatronDatasetBuilder``.

A recipe names its data as ``data.kind`` (``builtin``, ``indexed``, ``mock``) with ``data.blend`` or
``data.blend_per_split``; every prefix is checked (sizes against the ``.idx``) before megatron-core
touches it, and every split is checked to hold tokens (megatron-core would loop forever on an empty
one). Index caches go to ``data.cache_dir``/index so ``megatron-recipes data build-index`` can prepare
them once for a multi-node job.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable, List, Optional, Sequence, Tuple
from pathlib import Path

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.data import artifact_cache as cache
from megatron_recipes.data.indexed import check_indexed_prefix, content_fingerprint

Blend = Tuple[List[str], Optional[List[float]]]
SPLITS = ("train", "valid", "test")
log = logging.getLogger(__name__)


def dataset_sizes(cfg: RunConfig) -> List[int]:
    """Samples per split, as Megatron counts them: train for every step, valid for every evaluation."""
    gbs, iters = cfg.train.global_batch_size, cfg.train.train_iters
    lg = cfg.logging
    if lg.eval_interval > 0 and lg.eval_iters > 0:
        evals = iters // lg.eval_interval + 1
        return [iters * gbs, evals * lg.eval_iters * gbs, lg.eval_iters * gbs]
    return [iters * gbs, 0, 0]


def parse_blend(items: Sequence, where: str) -> Blend:
    """``[w1, prefix1, w2, prefix2, ...]`` or ``[prefix1, prefix2, ...]`` -> (prefixes, weights|None)."""
    items = list(items)
    if not items:
        raise RecipeError(f"{where} is empty", fix=f"set {where}=[/path/to/prefix] or [0.7,/a,0.3,/b]")

    def number(x) -> Optional[float]:
        if isinstance(x, bool):
            return None
        try:
            return float(x)
        except (TypeError, ValueError):
            return None

    numeric = [number(x) is not None for x in items]
    if not any(numeric):
        return [_absolute(x) for x in items], None
    pairs_ok = len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not pairs_ok:
        raise RecipeError(
            f"{where}={items} mixes weights and prefixes",
            fix="give weight/prefix pairs [0.7,/data/a,0.3,/data/b], or only prefixes",
        )
    weights = [number(w) for w in items[0::2]]
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        raise RecipeError(f"{where} has a weight that is not a positive finite number: {weights}",
                          fix="every weight must be a number > 0 (inf and nan are not weights)")
    return [_absolute(p) for p in items[1::2]], weights


def _absolute(prefix) -> str:
    """Absolute prefixes: the path is part of megatron-core's cache key, so it must not depend on the cwd."""
    return os.path.abspath(os.path.expanduser(str(prefix)))


def resolve_blends(cfg: RunConfig) -> Tuple[Optional[Blend], Optional[List[Optional[Blend]]]]:
    """(blend, blend_per_split) for megatron-core from the recipe's data kind and lists."""
    data = cfg.data
    if data.kind == "builtin" and not data.blend and not data.blend_per_split:
        from megatron_recipes.data.builtin import ensure_builtin_data

        return ([ensure_builtin_data(cfg).prefix], None), None
    if data.kind not in ("builtin", "indexed"):
        raise RecipeError(f"data.kind={data.kind} has no pretraining datasets", fix="use builtin, indexed or mock")
    if data.blend and data.blend_per_split:
        raise RecipeError("data.blend and data.blend_per_split are both set", fix="set only one of them")
    if data.blend_per_split:
        unknown = sorted(set(data.blend_per_split) - set(SPLITS))
        if unknown:
            raise RecipeError(f"data.blend_per_split has unknown split(s) {unknown}", fix=f"use keys {', '.join(SPLITS)}")
        if not data.blend_per_split.get("train"):
            raise RecipeError("data.blend_per_split has no train blend", fix="add a 'train' entry")
        per_split = [
            parse_blend(data.blend_per_split[s], f"data.blend_per_split.{s}") if data.blend_per_split.get(s) else None
            for s in SPLITS
        ]
        return None, per_split
    if not data.blend:
        raise RecipeError(
            "data.kind=indexed needs data.blend",
            fix="data.blend=[/path/to/prefix] or [0.7,/a,0.3,/b] (prefixes written by `megatron-recipes data preprocess`)",
        )
    return parse_blend(data.blend, "data.blend"), None


def _check_per_split_nonempty(per_split: Optional[List[Optional[Blend]]], infos: dict) -> None:
    for name, blend in zip(SPLITS, per_split or []):
        for prefix in blend[0] if blend else []:
            if infos[prefix].num_tokens == 0:
                raise RecipeError(f"data.blend_per_split.{name}: '{prefix}' holds no tokens", fix="remove it or preprocess real data")


def _check_prefixes(blend: Optional[Blend], per_split: Optional[List[Optional[Blend]]]) -> dict:
    blends = [blend] if blend else [b for b in (per_split or []) if b]
    return {p: check_indexed_prefix(p) for b in blends for p in b[0]}


def effective_split(cfg: RunConfig, blend: Optional[Blend], infos: dict, sizes: List[int]) -> str:
    """``data.split`` as megatron-core gets it; every split samples are drawn from must hold documents.

    megatron-core loops forever on a split without tokens. An empty split that no sample is drawn from
    (or the test split, which training never reads) is dropped with a warning; an empty train or valid
    split that is needed is an error.
    """
    if blend is None:
        return cfg.data.split
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:
        shares = [float(x) for x in str(cfg.data.split).split(",")]
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.data.split))
    except (AssertionError, ValueError, ZeroDivisionError):
        raise RecipeError(f"data.split='{cfg.data.split}' is not a valid split", fix='e.g. data.split="949,50,1"') from None
    shares += [0.0] * (len(SPLITS) - len(shares))
    for prefix in blend[0]:
        n = infos[prefix].num_sequences
        for i, (name, bounds, size) in enumerate(zip(SPLITS, matrix, sizes)):
            if bounds is None or int(round(bounds[1] * n)) > int(round(bounds[0] * n)):
                continue
            if size and name != "test":
                raise RecipeError(
                    f"data.split='{cfg.data.split}' leaves the {name} split of '{prefix}' empty ({n} documents)",
                    fix=f"give the {name} split a larger share, or use a dataset with more documents",
                )
            log.warning("data.split=%s leaves the %s split of %s empty (%d documents): not built", cfg.data.split, name, prefix, n)
            shares[i] = 0.0
    return ",".join(f"{x:g}" for x in shares)


def index_cache_path(cfg: RunConfig, blend: Optional[Blend], blend_per_split) -> str:
    """``data.cache_dir``/index/<key of the data's content>: megatron-core keys its caches on paths only.

    Every prefix's content fingerprint (``indexed.content_fingerprint``) goes into the folder name, so
    a dataset re-written at the same path gets fresh caches instead of the old ones' stale indices.
    """
    root = cache.index_cache_dir(cfg.data.cache_dir)
    blends = [blend] if blend else [b for b in (blend_per_split or []) if b]
    prefixes = sorted({p for b in blends for p in b[0]})
    if not prefixes:
        return str(root)
    return str(root / cache.content_key([[p, content_fingerprint(p)] for p in prefixes]))


def gpt_dataset_config(cfg: RunConfig, tokenizer, blend=None, blend_per_split=None, mock: bool = False, split=None):
    """megatron-core's ``GPTDatasetConfig`` for the recipe (no attention mask: the model builds it)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.train.seq_length,
        blend=None if mock else blend,
        blend_per_split=None if mock else blend_per_split,
        split=None if blend_per_split else (split or cfg.data.split),
        path_to_cache=index_cache_path(cfg, None if mock else blend, None if mock else blend_per_split),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )


def _index_build_lock(path_to_cache: Optional[str]):
    """Held by the process that writes megatron-core's index caches (global rank 0) while it builds: two
    jobs sharing ``data.cache_dir`` (the check's runs side by side) would otherwise race, one reading the
    ``.npy`` files the other is still writing (megatron-core saves them in place, checking only that they exist)."""
    import contextlib

    import torch.distributed as dist

    if not path_to_cache or (dist.is_initialized() and dist.get_rank() != 0):
        return contextlib.nullcontext()
    return cache.exclusive_lock(Path(path_to_cache) / ".build.lock")


def build_pretrain_datasets(cfg: RunConfig, tokenizer, is_built_on_rank: Optional[Callable[[], bool]] = None):
    """(train, valid, test) megatron-core datasets; call on every rank after torch.distributed is set up.

    ``is_built_on_rank`` defaults to every rank: reading on every TP rank and pipeline stage avoids
    broadcasts (the mmap'd indices make this cheap) and gives middle stages the same batch metadata.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron_recipes.data.gpt_datasets import GPTDataset, MockGPTDataset  # loss-mask cache fixed

    sizes = dataset_sizes(cfg)
    mock = cfg.data.kind == "mock"
    blend, per_split = (None, None) if mock else resolve_blends(cfg)
    if not mock:
        infos = _check_prefixes(blend, per_split)
        _check_per_split_nonempty(per_split, infos)
        split = effective_split(cfg, blend, infos, sizes)
    config = gpt_dataset_config(cfg, tokenizer, blend, per_split, mock=mock, split=None if mock else split)
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock else GPTDataset, sizes, is_built_on_rank or (lambda: True), config
    )
    try:
        with _index_build_lock(config.path_to_cache):
            train, valid, test = builder.build()
    except FileNotFoundError as exc:
        raise RecipeError(
            f"a dataset index cache file is missing on this rank: {exc.filename or exc}. Rank 0 builds the "
            f"caches under {config.path_to_cache}; other nodes cannot see them if that path is node-local",
            fix="set data.cache_dir to a shared filesystem path, or run `megatron-recipes data build-index "
            "<recipe> [overrides]` with the job's data.cache_dir on every node first",
        ) from None
    return train, valid, test

