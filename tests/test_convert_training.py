"""Continued training: HF Llama -> import -> 20 steps of `megatron-recipes train` -> export -> transformers.

The run starts from the import (``checkpoint.pretrained``), trains at TP=2 on two CPU ranks and saves at
step 20. The learning rate decays linearly to 0 at step 20, so step 20's update changes nothing and the
final weights are exactly those that produced the last logged loss: transformers, loading the exported
folder, must compute that loss on step 20's batch. Step 1's loss must likewise be the original HF
model's loss on step 1's batch (the run really started from the imported weights).

The vocabulary (768) needs no padding at TP=2: megatron-core's training loss is a softmax over the
*padded* vocabulary (padding rows are zero after import, so they carry probability mass), while the
exported model has the padding cut, so with padding the two losses differ by that mass (logits agree).
"""

from __future__ import annotations

import shlex

from pathlib import Path

import pytest
import torch

import train_support as ts
from convert_support import make_hf_model
from megatron_recipes.config.schema import ParallelConfig
from megatron_recipes.convert.exporter import run_export
from megatron_recipes.convert.importer import run_import

pytestmark = pytest.mark.slow

STEPS, GBS, MBS = 20, 8, 2
VOCAB = 768  # the built-in tokenizer's size here, a multiple of 128 x TP: no padded rows


def _hf_loss(hf_dir: Path, batch) -> float:
    """transformers' per-token loss over the batch's loss mask (the trainer's definition)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(batch["tokens"], position_ids=batch["position_ids"]).logits
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().double()
    return float((losses * mask).sum() / mask.sum())


def _global_batch(cfg, step: int):
    """The global batch the trainer used at ``step`` (1-based), rebuilt from the run's own recipe."""
    from megatron_recipes.data.batches import micro_batches
    from megatron_recipes.data.pretrain import build_pretrain_datasets
    from megatron_recipes.data.tokenizer import load_tokenizer
    from megatron_recipes.runtime.distributed import init_process_group, shutdown

    init_process_group()
    try:
        train, _, _ = build_pretrain_datasets(cfg, load_tokenizer(cfg))
        it = micro_batches(train, MBS, 0, 1, consumed_samples=(step - 1) * GBS)
        parts = [next(it) for _ in range(GBS // MBS)]
    finally:
        shutdown()
    return {key: torch.cat([p[key] for p in parts]) for key in ("tokens", "labels", "loss_mask", "position_ids")}


def test_import_train_export_matches_logged_loss(tmp_path, data_cache):
    from megatron_recipes.config.compose import from_yaml
    from megatron_recipes.convert.importer import train_command

    hf = make_hf_model("llama", tmp_path / "hf_llama", vocab_size=VOCAB)
    imported = run_import(hf, tmp_path / "imported", ParallelConfig(tp=2), progress=False)
    command = shlex.split(train_command(imported.out_dir, imported.cfg.model.name, "tiny_llama_cpu"))[3:]  # as a shell reads it
    run = ts.train(
        tmp_path / "run", data_cache, *command, *ts.FAST, f"train.train_iters={STEPS}",
        f"train.global_batch_size={GBS}", f"train.micro_batch_size={MBS}", "optimizer.lr=3e-3", "optimizer.min_lr=0",
        "optimizer.lr_decay_style=linear", f"optimizer.lr_decay_iters={STEPS - 1}", "optimizer.lr_warmup_iters=0",
        f"checkpoint.save_interval={STEPS}", "parallel.tp=2", f"data.builtin_vocab_size={VOCAB}", nproc=2,
    ).check()
    records = {r["step"]: r["data"] for r in run.records() if "loss" in r["data"]}
    assert records[STEPS]["lr"] == 0.0 and records[STEPS - 1]["lr"] > 0.0
    assert records[STEPS]["loss"] < records[1]["loss"] - 0.1, "the model did not train"

    exported = tmp_path / "exported"
    run_export(run.run_dir / "checkpoints", exported, progress=False)
    assert (exported / "generation_config.json").is_file()  # found through the run's checkpoint.pretrained

    cfg = from_yaml(run.run_dir / "config.yaml")
    first, last = _global_batch(cfg, 1), _global_batch(cfg, STEPS)
    assert _hf_loss(hf, first) == pytest.approx(records[1]["loss"], abs=1e-5)
    assert _hf_loss(exported, last) == pytest.approx(records[STEPS]["loss"], abs=1e-5)
