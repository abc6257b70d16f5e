"""Pretraining datasets (megatron-core GPTDataset / blends) and the resumable micro-batch iterator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data_support import one_rank_group, small_builtin, small_cfg

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.batches import micro_batches
from megatron_recipes.data.indexed import check_indexed_prefix
from megatron_recipes.data.pretrain import build_pretrain_datasets, dataset_sizes
from megatron_recipes.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    data = small_builtin(root)
    with one_rank_group():
        yield root, data


@pytest.fixture(scope="module")
def two_prefixes(env, tmp_path_factory):
    """Split the built-in corpus into two indexed datasets: even and odd documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    _, data = env
    out = tmp_path_factory.mktemp("blend")
    src = IndexedDataset(data.prefix)
    prefixes = [str(out / "even"), str(out / "odd")]
    for parity, prefix in enumerate(prefixes):
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=src.index.dtype)
        for i in range(parity, len(src), 2):
            builder.add_document(src[i], [len(src[i])])
        builder.finalize(prefix + ".idx")
    return prefixes


def test_builtin_datasets_and_batches(env):
    root, _ = env
    cfg = small_cfg(root, "train.train_iters=10", "logging.eval_interval=5", "logging.eval_iters=2")
    tok = load_tokenizer(cfg)
    train, valid, test = build_pretrain_datasets(cfg, tok)
    sizes = dataset_sizes(cfg)
    assert sizes == [10 * 16, 3 * 2 * 16, 2 * 16]
    assert len(train) >= sizes[0] and len(valid) >= sizes[1]
    assert test is None  # 0.1% of 80 documents is none: dropped (training never reads test)
    _, _, test = build_pretrain_datasets(small_cfg(root, "data.split='90,8,2'"), tok)
    assert len(test) >= dataset_sizes(small_cfg(root))[2]
    batch = next(micro_batches(train, 4, 0, 2))
    s = cfg.train.seq_length
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "tokens": ((4, s), torch.int64),
        "labels": ((4, s), torch.int64),
        "loss_mask": ((4, s), torch.float32),
        "position_ids": ((4, s), torch.int64),
    }
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][0], torch.arange(s))
    assert int(batch["tokens"].max()) < tok.vocab_size


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_resume_gives_identical_batches(env):
    root, _ = env
    cfg = small_cfg(root, "train.train_iters=20")
    train, _, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
    mbs, dp = 2, 2
    for rank in range(dp):
        straight = micro_batches(train, mbs, rank, dp)
        first = _take(straight, 7)
        resumed = micro_batches(train, mbs, rank, dp, consumed_samples=straight.consumed_samples - 4 * mbs * dp)
        assert straight.consumed_samples == 7 * mbs * dp
        for a, b in zip(first[3:], _take(resumed, 4)):
            for key in a:
                assert torch.equal(a[key], b[key])
        assert resumed.consumed_samples == straight.consumed_samples
    # the DP ranks' slices tile the global order
    r0, r1 = micro_batches(train, mbs, 0, dp), micro_batches(train, mbs, 1, dp)
    for step in range(3):
        b0, b1 = next(r0), next(r1)
        for j in range(mbs):
            assert torch.equal(b0["tokens"][j], train[step * mbs * dp + j]["tokens"])
            assert torch.equal(b1["tokens"][j], train[step * mbs * dp + mbs + j]["tokens"])
    # a worker process gives the same batches
    with_worker = _take(micro_batches(train, mbs, 1, dp, consumed_samples=8, num_workers=1), 3)
    inline = _take(micro_batches(train, mbs, 1, dp, consumed_samples=8), 3)
    for a, b in zip(with_worker, inline):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_way_blend_draws_by_weight(env, two_prefixes):
    root, _ = env
    a, b = two_prefixes
    cfg = small_cfg(root, "data=indexed", f"data.blend=[0.75,{a},0.25,{b}]", "data.tokenizer=builtin", "train.train_iters=40")
    train, valid, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
    ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
    assert len(train) == dataset_sizes(cfg)[0]
    assert abs((ids == 0).mean() - 0.75) < 0.02 and set(ids.tolist()) == {0, 1}
    batch = next(micro_batches(train, 8, 0, 1))
    assert "dataset_id" not in batch and batch["tokens"].shape == (8, cfg.train.seq_length)


def test_blend_per_split(env, two_prefixes):
    root, _ = env
    a, b = two_prefixes
    cfg = small_cfg(
        root,
        "data=indexed",
        f"+data.blend_per_split={{train:[1,{a},1,{b}],valid:[{b}],test:[{b}]}}",
        "train.train_iters=10",
    )
    train, valid, test = build_pretrain_datasets(cfg, load_tokenizer(cfg))
    assert {int(train[i]["dataset_id"]) for i in range(len(train))} == {0, 1}
    assert len(valid) >= dataset_sizes(cfg)[1] and test is not None


def test_truncated_and_missing_files_are_clear_errors(env, two_prefixes, tmp_path):
    root, _ = env
    a, _ = two_prefixes
    info = check_indexed_prefix(a)
    assert info.num_documents == info.num_sequences > 0
    for suffix, cut in ((".bin", 7), (".idx", 16)):
        prefix = str(tmp_path / f"cut{suffix[1:]}")
        for ext in (".bin", ".idx"):
            Path(prefix + ext).write_bytes(Path(a + ext).read_bytes())
        data = Path(prefix + suffix).read_bytes()
        Path(prefix + suffix).write_bytes(data[:-cut])
        with pytest.raises(RecipeError, match="truncated"):
            check_indexed_prefix(prefix)
        cfg = small_cfg(root, "data=indexed", f"data.blend=[{prefix}]")
        with pytest.raises(RecipeError, match=f"{Path(prefix).name}.*truncated"):
            build_pretrain_datasets(cfg, load_tokenizer(cfg))
    with pytest.raises(RecipeError, match="missing"):
        check_indexed_prefix(str(tmp_path / "absent"))
    Path(str(tmp_path / "junk.idx")).write_bytes(b"not an index at all, really not" * 2)
    Path(str(tmp_path / "junk.bin")).write_bytes(b"")
    with pytest.raises(RecipeError, match="not a megatron-core index"):
        check_indexed_prefix(str(tmp_path / "junk"))


def test_bad_blends_and_splits(env, two_prefixes):
    root, _ = env
    a, b = two_prefixes
    tok = load_tokenizer(small_cfg(root))
    with pytest.raises(RecipeError, match="mixes weights and prefixes"):
        build_pretrain_datasets(small_cfg(root, "data=indexed", f"data.blend=[0.5,{a},{b}]"), tok)
    with pytest.raises(RecipeError, match="needs data.blend"):
        build_pretrain_datasets(small_cfg(root, "data=indexed"), tok)
    with pytest.raises(RecipeError, match="valid split .* empty"):
        build_pretrain_datasets(small_cfg(root, "data=indexed", f"data.blend=[{a}]", "data.split='99,0.0001,1'"), tok)


def test_batch_iterator_errors(env):
    root, _ = env
    cfg = small_cfg(root, "train.train_iters=4")
    train, _, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
    with pytest.raises(RecipeError, match="consumed_samples"):
        micro_batches(train, 2, 0, 1, consumed_samples=len(train) + 1)
    with pytest.raises(RecipeError, match="dp_rank"):
        micro_batches(train, 2, 2, 2)
    it = micro_batches(train, 2, 0, 1, consumed_samples=len(train) - 3)
    next(it)
    with pytest.raises(StopIteration):  # the incomplete last step is dropped
        next(it)
    cyc = micro_batches(train, 2, 0, 1, consumed_samples=len(train) - 1, cycle=True)
    first = next(cyc)
    assert torch.equal(first["tokens"][1], train[0]["tokens"])


def _rank_main(cache_dir: str) -> list:
    import os

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = small_cfg(Path(cache_dir), "train.train_iters=6", "+data.blend_per_split={}")
        tok = load_tokenizer(cfg)  # every rank asks for the built-in corpus at once: one builds
        train, _, _ = build_pretrain_datasets(cfg, tok)
        return [b["tokens"] for b in _take(micro_batches(train, 2, rank, world), 3)]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_build_concurrently_and_slice_the_global_order(tmp_path):
    from multiproc import run_ranks

    out = run_ranks(_rank_main, 2, str(tmp_path))
    with one_rank_group():
        cfg = small_cfg(tmp_path, "train.train_iters=6")
        train, _, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
        single = [b["tokens"] for b in _take(micro_batches(train, 4, 0, 1), 3)]
    for step in range(3):
        assert torch.equal(torch.cat([out[0][step], out[1][step]]), single[step])


def test_mock_kind_uses_megatron_mock_dataset(env):
    root, _ = env
    cfg = small_cfg(root, "data=mock", "train.train_iters=3")
    train, valid, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
    assert type(train).__name__ == "MockGPTDataset" and len(train) >= 3 * 16
    batch = next(micro_batches(train, 2, 0, 1))
    assert batch["tokens"].shape == (2, cfg.train.seq_length)


def test_each_sample_keeps_its_own_loss_mask_whatever_is_read_first(env):
    """megatron-core caches the first sample's loss mask by reference and masks its pad labels in place;
    without the fix every later sample loses those positions too, so the masks depended on the order of
    reading (a DP rank's slice, a resume step). Mock tokens cycle through the vocabulary, pad id included."""
    root, _ = env
    cfg = small_cfg(root, "data=mock", "train.train_iters=2", "train.seq_length=1024")
    tok = load_tokenizer(cfg)
    forward, _, _ = build_pretrain_datasets(cfg, tok)
    backward, _, _ = build_pretrain_datasets(cfg, tok)
    n = 8
    masks_forward = [forward[i]["loss_mask"] for i in range(n)]
    masks_backward = [backward[i]["loss_mask"] for i in reversed(range(n))][::-1]
    masked = [int((m == 0).sum()) for m in masks_forward]
    assert max(masked) > 0, "no pad label in these samples: the test would prove nothing"
    for i in range(n):
        assert torch.equal(masks_forward[i], masks_backward[i]), f"sample {i}: mask depends on the reading order"


def test_index_caches_are_built_under_the_cache_lock(env):
    """Two jobs sharing data.cache_dir (the check's runs side by side): while another process builds the
    index caches (holding the lock), this one waits instead of reading half-written .npy files."""
    import threading
    import time

    from megatron_recipes.data import artifact_cache as cache
    from megatron_recipes.data.pretrain import gpt_dataset_config, resolve_blends

    root, _ = env
    cfg = small_cfg(root, "train.train_iters=7", "seed=4321")  # caches no other test has built
    tok = load_tokenizer(cfg)
    folder = Path(gpt_dataset_config(cfg, tok, *resolve_blends(cfg)).path_to_cache)
    before = set(folder.glob("*.npy"))
    done = []
    with cache.exclusive_lock(folder / ".build.lock"):  # the other builder
        worker = threading.Thread(target=lambda: done.append(build_pretrain_datasets(cfg, tok)))
        worker.start()
        time.sleep(3)
        assert not done and set(folder.glob("*.npy")) == before  # waiting: nothing read, nothing written
    worker.join(120)
    assert done and set(folder.glob("*.npy")) > before
