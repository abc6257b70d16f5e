"""`data build-index`: caches built ahead of a job are hit by every rank, even on node-local storage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_support import small_builtin, small_cfg, stdlib_texts, write_jsonl
from multiproc import run_ranks

from megatron_recipes.cli import main as cli_main
from megatron_recipes.data.preprocess import preprocess


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A shared indexed dataset and tokenizer (as on a shared filesystem)."""
    root = tmp_path_factory.mktemp("shared")
    tok_dir = str(small_builtin(root / "cache").tokenizer_dir)
    write_jsonl(root / "docs.jsonl", [{"text": t} for t in stdlib_texts(200)])
    preprocess(str(root / "docs.jsonl"), str(root / "docs"), tok_dir, workers=1, show_progress=False)
    return root, tok_dir, str(root / "docs")


def _overrides(tok_dir: str, prefix: str, cache_dir: Path):
    return ["data=indexed", f"data.tokenizer={tok_dir}", f"data.blend=[{prefix}]", f"data.cache_dir={cache_dir}",
            "data.split='90,8,2'", "train.train_iters=5"]


def _rank(tok_dir: str, prefix: str, caches):
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.data.batches import micro_batches
    from megatron_recipes.data.pretrain import build_pretrain_datasets
    from megatron_recipes.data.tokenizer import load_tokenizer

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    cfg = small_cfg(Path(caches[rank]), *_overrides(tok_dir, prefix, Path(caches[rank])))  # "node-local" cache
    try:
        train, _, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
        return next(micro_batches(train, 2, rank, 2))["tokens"]
    except RecipeError as exc:
        return exc.render()
    except Exception as exc:  # rank 0 may see its peer leave during a barrier
        return f"{type(exc).__name__}"
    finally:
        dist.destroy_process_group()  # lets the peer's pending barrier fail now, not at the timeout


def _run_two_ranks(tok_dir, prefix, caches):
    return dict(enumerate(run_ranks(_rank, 2, tok_dir, prefix, caches)))


@pytest.mark.slow
def test_node_local_caches_fail_clearly_then_work_after_build_index(corpus, capsys):
    root, tok_dir, prefix = corpus
    caches = [str(root / "node0"), str(root / "node1")]
    out = _run_two_ranks(tok_dir, prefix, caches)
    assert isinstance(out[1], str) and "index cache file is missing" in out[1] and "build-index" in out[1]

    for cache in caches:  # what a user does on every node (or once, on a shared path)
        assert cli_main(["data", "build-index", "tiny_llama_cpu", *_overrides(tok_dir, prefix, Path(cache))]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "train: " in printed and f"data.cache_dir={Path(caches[1]).resolve()}" in printed
    assert "build-index: Build and save the GPTDataset train indices" in captured.err  # megatron-core's own progress
    files0 = sorted(str(p.relative_to(caches[0])) for p in Path(caches[0]).joinpath("index").rglob("*.npy"))
    assert files0 == sorted(str(p.relative_to(caches[1])) for p in Path(caches[1]).joinpath("index").rglob("*.npy"))
    assert len(files0) >= 9

    out = _run_two_ranks(tok_dir, prefix, caches)
    assert all(isinstance(out[r], torch.Tensor) for r in (0, 1)), out
    assert not torch.equal(out[0], out[1])  # each DP rank got its own slice
    assert sorted(str(p.relative_to(caches[0])) for p in Path(caches[0]).joinpath("index").rglob("*.npy")) == files0  # hit
