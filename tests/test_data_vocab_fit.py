"""Token ids outside the model's vocabulary never train (issue 30, case 8).

Under TP>1 megatron-core's vocab-parallel embedding zeroes an id outside every rank's slice and its
vocab-parallel loss ignores such labels, so data tokenized for a bigger vocabulary trained silently wrong;
under TP=1 it crashed with an IndexError. Preprocessing records the largest id (checked before any rank
starts); every micro-batch is checked on the host as well (data written without that record).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import train_support as ts
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.batches import check_token_ids
from megatron_recipes.data.idx_writer import STATS_SUFFIX, indexed_writer, read_stats
from megatron_recipes.data.indexed import check_fits_vocab, check_indexed_prefix

VOCAB = 4096  # recipes/model/tiny_llama.yaml


def _write(prefix: str, top: int, docs: int = 48, length: int = 80) -> None:
    rng = np.random.default_rng(0)
    with indexed_writer(prefix, np.uint16) as writer:
        ids = rng.integers(0, 500, size=(docs, length)).astype(np.uint16)
        ids[docs // 2, 3] = top  # one id at the top, in the middle of the data
        writer.add_batch(ids.reshape(-1), np.full(docs, length))


def test_a_micro_batch_with_an_id_outside_the_vocabulary_is_refused():
    batch = {"tokens": torch.tensor([[1, 2, VOCAB - 1]]), "labels": torch.tensor([[2, VOCAB - 1, 3]])}
    check_token_ids(batch, VOCAB, 0)  # the last row of the vocabulary is in it
    batch["labels"][0, 2] = VOCAB
    with pytest.raises(RecipeError, match=f"token id {VOCAB} .*labels.*model.vocab_size={VOCAB}"):
        check_token_ids(batch, VOCAB, 16)


def test_the_recorded_largest_id_is_checked_before_training(tmp_path):
    prefix = str(tmp_path / "big")
    _write(prefix, VOCAB + 10)
    info = check_indexed_prefix(prefix)
    assert info.max_token_id == VOCAB + 10
    with pytest.raises(RecipeError, match=f"token ids up to {VOCAB + 10}.*model.vocab_size={VOCAB}"):
        check_fits_vocab(info, VOCAB)
    check_fits_vocab(info, VOCAB + 11)
    with open(prefix + ".bin", "ab") as handle:  # a record that no longer describes the .bin is not trusted
        handle.write(b"\0\0")
    assert read_stats(prefix) == {}


@pytest.mark.slow
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "unrecorded"])
def test_training_refuses_data_tokenized_for_a_bigger_vocabulary_at_tp2(tmp_path, cache, record):
    prefix = str(tmp_path / "big")
    _write(prefix, VOCAB + 100)
    if not record:
        os.remove(prefix + STATS_SUFFIX)  # written by another tool: each micro-batch is checked instead
    run = ts.train(tmp_path / "run", cache, *ts.FAST, "data=indexed", f"data.blend=[{prefix}]", "train.train_iters=30",
                   "checkpoint.save_interval=1000", nproc=2)
    assert run.returncode != 0, run.output[-3000:]
    assert f"model.vocab_size={VOCAB}" in run.output and str(VOCAB + 100) in run.output, run.output[-3000:]
    # recorded: refused by the validation before any model is built; else by the first micro-batch holding it
    said = f"holds token ids up to {VOCAB + 100}" if record else f"the data holds token id {VOCAB + 100}"
    assert said in run.output and ("training tiny_llama" not in run.output) == record, run.output[-3000:]
