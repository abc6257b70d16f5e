"""Megatron-FSDP zero3 keeps its parameters sharded through an evaluation and a save (issue 24, finding 3).

Why: before an evaluation and a save the trainer completes megatron DDP's deferred parameter all-gathers
(``optim.finish_param_sync``). Megatron-FSDP sets ``overlap_param_gather`` itself under zero3, and the
forced sync there gathers every bucket and keeps it: the whole unsharded model on every rank at each
evaluation and save (~141 GB per GPU for llama3_70b_sft_fsdp). Megatron-LM skips it under Megatron-FSDP,
whose units gather and free their own parameters and whose checkpoints are written from the shards.

What stays resident is read from Megatron-FSDP's own state: the storage its all-gather pipeline holds for
the unsharded weight buckets. Its prefetch window (``suggested_AG_prefetch_size``, at least 5e8 elements
by default) holds this 1.8M-parameter model whole, so the window is set to one bucket on the built object,
as a model of billions of parameters sees it; without that, both behaviours would hold the whole model.
Two ranks, zero3, fp32 (the checkpoint stores the weights exactly), through the trainer's own set-up,
step, evaluation and save; the forced gather the old code did runs last, as the reference: the
evaluation gives the same loss; the checkpoint holds the weights (the optimizer's distributed parameters,
gathered whole) bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import train_support as ts
from multiproc import run_ranks

pytestmark = pytest.mark.slow


def _weight_buffers(model):
    for chunk in model:
        for group in chunk.module.param_and_grad_buffer.parameter_groups:
            wbuf = group.model_weight_buffer
            if wbuf is not None and wbuf.is_data_distributed:
                yield wbuf


def resident_bytes(model) -> int:
    """Bytes of unsharded weight buckets Megatron-FSDP's all-gather pipeline holds right now."""
    total = 0
    for wbuf in _weight_buffers(model):
        bucket = wbuf.temporary_bucket_allocator.buckets.get(wbuf.bucket_index.bucket_id)
        total += bucket.data.untyped_storage().nbytes() if bucket is not None else 0
    return total


def _rank(run_dir: str, cache: str):
    from megatron_recipes import checkpoint
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import loop

    cfg = compose_recipe("tiny_llama_cpu", [
        f"run.dir={run_dir}", f"data.cache_dir={cache}", "cluster.gpus_per_node=2", "cluster.nvlink_domain=2",
        *ts.SMALL_DATA, *ts.FAST, "parallel=none", "parallel.fsdp=true", "parallel.sharding=zero3",
        "optimizer.use_distributed_optimizer=true", "precision=fp32", "train.train_iters=2", "logging.eval_iters=1",
        "checkpoint.save_interval=0",
    ])
    trainer = loop.Trainer(cfg, distributed.init_model_parallel(cfg))
    out = {}
    try:
        trainer.setup()
        for chunk in trainer.model:
            chunk.module.suggested_AG_prefetch_size = 1  # one bucket at a time (see the module docstring)
        out["whole"] = sum(w.bucket_index.size * w.dtype.itemsize for w in _weight_buffers(trainer.model))
        peak = [0]

        def record(*_):  # before each module's forward (after Megatron-FSDP's own hooks)
            peak[0] = max(peak[0], resident_bytes(trainer.model))

        inner = [chunk.module.module for chunk in trainer.model]  # the GPTModel under Megatron-FSDP
        handles = [m.register_forward_pre_hook(record) for model in inner for m in model.modules()]
        trainer.advance()
        out["step_peak"], out["after_step"] = peak[0], resident_bytes(trainer.model)
        peak[0] = 0
        out["val_loss"] = trainer.evaluate_metrics()["val_loss"]
        out["eval_peak"], out["after_eval"] = peak[0], resident_bytes(trainer.model)
        for h in handles:
            h.remove()

        trainer.save()
        out["after_save"] = resident_bytes(trainer.model)
        out["checkpoint"] = str(checkpoint.latest(cfg))

        # the reference: what the old code did before both (every bucket gathered), then read the weights
        for chunk in trainer.model:
            chunk.start_param_sync(force_sync=True)
        out["forced"] = resident_bytes(trainer.model)
        out["weights"] = {  # this rank's rows of the distributed parameters the optimizer steps
            f"model.module.{n}": p.to_local().detach().clone() for n, p in inner[0].named_parameters()
        }
        out["val_loss_forced"] = trainer.evaluate_metrics()["val_loss"]
    finally:
        trainer.close()
    return out


def test_zero3_eval_and_save_keep_parameters_sharded(tmp_path, cache):
    ranks = run_ranks(_rank, 2, str(tmp_path / "run"), str(cache), timeout=900)
    stored = ts.stored_tensors(Path(ranks[0]["checkpoint"]))
    for rank, seen in enumerate(ranks):
        whole = seen["whole"]
        assert seen["forced"] == whole, f"rank {rank}: the measure misses a full gather: {seen['forced']} of {whole}"
        assert seen["step_peak"] < whole, f"rank {rank}: a step's forward holds {seen['step_peak']} of {whole} bytes"
        # an evaluation's forward holds no more than a training forward; afterwards, and after a save, no
        # more than a step leaves (the next forward's first buckets, prefetched by the optimizer step)
        for when, bound in (("eval_peak", "step_peak"), ("after_eval", "after_step"), ("after_save", "after_step")):
            assert seen[when] <= seen[bound], (
                f"rank {rank}: {when} holds {seen[when]} bytes of unsharded weights, {bound} {seen[bound]} "
                f"(the whole model: {whole})")
        assert seen["val_loss"] == seen["val_loss_forced"], f"rank {rank}"
    # the weights: each parameter's rows, rank 0's then rank 1's (Megatron-FSDP shards its flat buffer in order)
    names = ranks[0]["weights"]
    assert names and set(names) <= set(stored), sorted(set(names) - set(stored))[:5]
    whole = {k: torch.cat([seen["weights"][k] for seen in ranks]) for k in names}
    differ = [k for k, w in whole.items() if not torch.equal(stored[k], w)]
    assert not differ, f"the checkpoint differs from the weights in {differ[:5]}"
