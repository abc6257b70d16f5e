"""A packed SFT batch under PP=2 gives the loss of the same samples unpacked (real ranks, real model).

Both batches go through the trainer's forward step and megatron-core's 1F1B schedule on one model:
every pipeline stage rebuilds the block-diagonal mask from its own ``segment_ids``, and the loss is
normalised per token over the whole batch, so packing may only change float32 rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from data_support import small_builtin, small_cfg, write_jsonl
from multiproc import run_ranks

SEQ = 256


def _conversations(n: int):
    rng = random.Random(5)
    words = "alpha beta gamma delta import return class yield lambda value".split()
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [
        {"messages": [{"role": "user", "content": say(rng.randint(1, 6))}, {"role": "assistant", "content": say(rng.randint(1, 8))}]}
        for _ in range(n)
    ]


def _rank_losses(cache_dir: str, sft_path: str):
    import torch

    from megatron_recipes.data.batches import micro_batches
    from megatron_recipes.data.sft.dataset import build_sft_datasets
    from megatron_recipes.data.tokenizer import load_tokenizer
    from megatron_recipes.models import capabilities
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import step

    losses, rows = {}, {}
    for packing in ("true", "false"):
        cfg = small_cfg(
            Path(cache_dir), "parallel=pp2", "cluster.gpus_per_node=2", "data.kind=sft", f"data.sft_path={sft_path}",
            f"data.packing={packing}", f"train.seq_length={SEQ}", "train.micro_batch_size=1", "train.train_iters=1",
            "model.init_method_std=0.3",  # a random model that does depend on context, so leaks would show
        )
        tok = load_tokenizer(cfg)
        train, _, _, summary = build_sft_datasets(cfg, tok)
        assert summary["train"].truncated == 0 and summary["train"].kept == 14
        rows[packing] = summary["train"].rows
        cfg.train.global_batch_size = rows[packing]  # one global batch = every sample exactly once
        if packing == "true":
            runtime = distributed.init_model_parallel(cfg)
            torch.manual_seed(0)
            model = build_model_chunks(cfg)
            forward = step.make_forward_step(runtime.device, capabilities.use_transformer_engine())
        iterators = [micro_batches(train, 1, 0, 1) for _ in model]
        losses[packing] = step.evaluate(cfg, model, iterators, forward, runtime.device, num_iters=1)
    return losses, rows


@pytest.mark.slow
def test_packed_pp2_loss_equals_unpacked(tmp_path):
    small_builtin(tmp_path)  # build the corpus once, before the ranks start
    sft = write_jsonl(tmp_path / "sft.jsonl", _conversations(14))
    results = run_ranks(_rank_losses, 2, str(tmp_path), str(sft), timeout=900)
    (losses0, rows), (losses1, _) = results
    assert rows["true"] < rows["false"] == 14  # packing really put several samples in a row
    assert losses0 == losses1  # both stages report the reduced loss
    assert losses0["true"] == pytest.approx(losses0["false"], rel=1e-5, abs=0)
    assert 1.0 < losses0["false"] < 30.0
