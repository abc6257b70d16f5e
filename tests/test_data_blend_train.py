"""A pretraining recipe with a 2-way blend trains on the CPU lane (the real trainer, 2 ranks, TP=2)."""

from __future__ import annotations

import math

import pytest

from data_support import small_builtin, stdlib_texts, write_jsonl
from train_support import FAST, train

from megatron_recipes.data.preprocess import preprocess


@pytest.mark.slow
def test_two_way_blend_trains_on_cpu(tmp_path):
    cache = tmp_path / "cache"
    tok_dir = str(small_builtin(cache).tokenizer_dir)  # the same tokenizer the run's data.tokenizer names
    texts = stdlib_texts(400)
    prefixes = []
    for name, part in (("code", texts[::2]), ("prose", [t.replace("def ", "the ") for t in texts[1::2]])):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"text": t} for t in part])
        preprocess(str(tmp_path / f"{name}.jsonl"), str(tmp_path / name), tok_dir, workers=1, show_progress=False)
        prefixes.append(str(tmp_path / name))
    run = train(
        tmp_path / "run",
        cache,
        "data=blend2",
        f"data.blend=[0.7,{prefixes[0]},0.3,{prefixes[1]}]",
        f"data.tokenizer={tok_dir}",
        *FAST,
        "train.train_iters=30",
        "logging.eval_interval=15",
        "logging.eval_iters=1",
        "checkpoint.save_interval=1000",
        nproc=2,
    ).check()
    losses = run.series("loss")
    val = run.series("val_loss")
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns from the blended stream
    assert len(val) == 2 and all(math.isfinite(x) for x in val)
    index = list((cache / "index").rglob("*"))  # one folder per data content key (data/pretrain.index_cache_path)
    assert any("BlendedDataset" in p.name for p in index)  # megatron-core's blend, cached under data.cache_dir
