"""Shared helpers for the data tests: small recipes, a one-rank gloo group, small corpora."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterable, List

import torch.distributed as dist

# Small built-in corpus: seconds to build, enough documents for every split.
SMALL_BUILTIN = ["data.builtin_max_files=80", "data.builtin_vocab_size=600"]


def small_cfg(cache_dir: Path, *overrides: str, recipe: str = "tiny_llama_cpu"):
    from megatron_recipes.config.compose import compose_recipe

    return compose_recipe(recipe, [f"data.cache_dir={cache_dir}", *SMALL_BUILTIN, *overrides])


def small_builtin(cache_dir: Path):
    """The small built-in corpus (tokenizer dir + indexed prefix), built once per cache dir."""
    from megatron_recipes.config.schema import DataConfig
    from megatron_recipes.data.builtin import builtin_data_for

    return builtin_data_for(DataConfig(kind="builtin", cache_dir=str(cache_dir), builtin_max_files=80, builtin_vocab_size=600))


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group (megatron-core's blended builder calls torch.distributed.get_rank), on an
    in-memory store: no port, nothing written into the environment that later subprocesses inherit."""
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def write_jsonl(path: Path, records: Iterable[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def stdlib_texts(count: int, start: int = 0) -> List[str]:
    """Real, varied text (standard-library sources) for corpora in tests."""
    from megatron_recipes.data.builtin import stdlib_sources

    texts = []
    for path in stdlib_sources(start + count * 2)[start:]:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            texts.append(text[:4000])
        if len(texts) == count:
            break
    return texts
