"""Held-out loss on the run's own validation split, computed as the trainer computes ``val_loss``.

Why the trainer's own pieces (``build_datasets``, ``micro_batches``, ``step.evaluate_with_accuracy``): the
figure must be the one the log printed at that step, so that a user comparing ``eval`` with
``log.jsonl`` compares like with like. With the run's ``logging.eval_iters`` (the default) it reads the same
first global batches the trainer evaluated on; another ``eval_iters`` sizes the split the way training would
have sized it with that setting.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

import torch

from megatron_recipes.config.derived import mtp_stage
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig, TrainConfig


def run_batches(cfg: RunConfig, trained: TrainConfig) -> RunConfig:
    """``cfg`` (the model at eval's layout) reading the run's global batches: its global batch size, and its
    micro-batch size where this layout's data-parallel size divides the batch into them."""
    from megatron_recipes.config.derived import data_parallel_size

    dp = data_parallel_size(cfg)
    gbs, mbs = trained.global_batch_size, trained.micro_batch_size
    if gbs % dp:
        raise RecipeError(
            f"the run's global batch of {gbs} sequences does not split over {dp} data-parallel ranks at this layout",
            fix="evaluate at the run's layout, or with parallel.* giving a data-parallel size that divides it",
        )
    if gbs % (mbs * dp):
        mbs = 1
    train = dataclasses.replace(cfg.train, global_batch_size=gbs, micro_batch_size=mbs, seq_length=trained.seq_length)
    return dataclasses.replace(cfg, train=train)


def heldout_loss(cfg: RunConfig, model: torch.nn.Module, eval_iters: Optional[int], trained: TrainConfig) -> Dict[str, float]:
    """``val_loss``, ``perplexity`` and the batches read (every rank of the layout calls this); ``trained``:
    the run's own ``train`` settings (the batches it evaluated on)."""
    from megatron.core import parallel_state

    from megatron_recipes.data.batches import micro_batches
    from megatron_recipes.data.datasets import build_datasets
    from megatron_recipes.data.tokenizer import load_tokenizer
    from megatron_recipes.models import capabilities
    from megatron_recipes.training import step

    iters = int(eval_iters or cfg.logging.eval_iters)
    if iters < 1:
        raise RecipeError(
            "the run evaluated no validation batches (logging.eval_iters=0)", fix="pass eval_iters=<batches> to eval"
        )
    cfg = run_batches(dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, eval_iters=iters)), trained)
    if cfg.data.kind == "builtin":
        from megatron_recipes.data.builtin import ensure_builtin_data

        ensure_builtin_data(cfg)
    _, valid, _ = build_datasets(cfg, load_tokenizer(cfg))
    if valid is None:
        raise RecipeError(
            "the run's data has no validation split (data.split / data.sft_valid_path give it none)",
            fix="eval what=answers for a fine-tuning run, or a run with a validation split",
        )
    device = next(model.parameters()).device
    batches = micro_batches(
        valid, cfg.train.micro_batch_size, parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(), 0, cfg.data.num_workers, vocab_size=cfg.model.vocab_size,
    )
    forward_step = step.make_forward_step(device, capabilities.use_transformer_engine(), mtp=mtp_stage(cfg))
    loss, _ = step.evaluate_with_accuracy(cfg, [model], [batches], forward_step, device, iters)
    model.eval()  # the trainer's evaluation puts chunks back in training mode
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_iters": iters,
            "sequences": iters * cfg.train.global_batch_size}
