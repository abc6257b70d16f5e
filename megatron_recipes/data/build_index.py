"""`data build-index`: build megatron-core's dataset index caches once, before a multi-node job.

megatron-core builds these caches (document/sample/shuffle indices) on global rank 0 only and lets
the other ranks read them; on node-local storage the other nodes then fail with FileNotFoundError.
Building them here, with exactly the recipe's settings (same cache key), in ``data.cache_dir`` on a
shared filesystem (or on every node's local path) means every rank of the job gets a cache hit.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

from megatron_recipes.config.schema import RunConfig


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo group when none exists (megatron-core's blend builder asks for the rank)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port, no environment
    try:
        yield
    finally:
        dist.destroy_process_group()


def _files(folder) -> set:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


@contextlib.contextmanager
def megatron_core_progress() -> Iterator[None]:
    """megatron-core's own INFO lines while it builds (each index it builds or loads, with its time) on
    stderr: a build of minutes is otherwise silent."""
    import logging
    import sys

    log = logging.getLogger("megatron.core.datasets")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("build-index: %(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def build_index_caches(cfg: RunConfig) -> List[str]:
    """Build (or find) every index cache the recipe's job will read; returns lines to print."""
    from megatron_recipes.data import artifact_cache as cache
    from megatron_recipes.data.pretrain import build_pretrain_datasets, dataset_sizes
    from megatron_recipes.data.tokenizer import load_tokenizer

    folder = cache.index_cache_dir(cfg.data.cache_dir)  # one sub-folder per data content (pretrain.index_cache_path)
    before = _files(folder)
    tokenizer = load_tokenizer(cfg)
    with single_process_group(), megatron_core_progress():
        datasets = build_pretrain_datasets(cfg, tokenizer)
    after = _files(folder)
    lines = [f"index caches in {folder}: {len(after - before)} new file(s), {len(after)} in total"]
    for name, ds, wanted in zip(("train", "valid", "test"), datasets, dataset_sizes(cfg)):
        lines.append(f"  {name}: " + ("not built" if ds is None else f"{len(ds):,} samples (job needs {wanted:,})"))
    lines.append(f"run the job with data.cache_dir={cache.cache_root(cfg.data.cache_dir)}")
    return lines
