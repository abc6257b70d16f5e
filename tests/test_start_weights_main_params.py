"""The optimizer's fp32 main params equal the start weights once the trainer is built.

Mixed precision trains the fp32 main params and copies them back into the bf16/fp8 model weights after
every step, so main params that came from anywhere but the loaded checkpoint silently replace it at step 1.
The trainer loads start weights into the bare model before it builds the optimizer; under Transformer
Engine's ``fp8_model_init(preserve_high_precision_init_val=True)`` (megatron-core enters it for
``fp8_param_gather``) every weight also keeps its random init, and megatron-core's DistributedOptimizer
builds its main params from that kept value, not from the weight (distrib_optimizer.py,
``get_high_precision_init_val``).

There is no fp8 and no TE on the CPU lane, so one case EMULATES TE's attribute: each decoder weight gets
the ``get_high_precision_init_val`` / ``clear_high_precision_init_val`` pair TE attaches (holding the
random init) before the start weights are loaded, and megatron-core's DistributedOptimizer is told those
weights are fp8 tensors, so it takes the same branch it takes on a GPU. That case tests our set-up order
(load, build, then re-read the main params), not TE.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import train_support as ts
from multiproc import run_ranks

pytestmark = pytest.mark.slow

CASES = {  # name: (use_distributed_optimizer, emulate TE's preserved init)
    "distributed": (True, False),
    "non_distributed": (False, False),
    "distributed_te_preserved_init": (True, True),
}


_RANDOM_INIT = []  # (weight, its random init) of the emulated weights, in this rank's process


def _emulate_te_preserved_init() -> None:
    """TE's fp8_model_init(preserve_high_precision_init_val=True), EMULATED: each decoder weight keeps a
    host copy of its random init behind TE's get/clear pair (TE's clear deletes the value and leaves the
    getter, which then returns None); megatron-core's DistributedOptimizer takes its fp8 branch for them."""
    from types import MethodType

    from megatron.core.optimizer import distrib_optimizer

    import megatron_recipes.models.builder as builder

    def get(param):
        return getattr(param, "_high_precision_init_val", None)

    def clear(param):
        if hasattr(param, "_high_precision_init_val"):
            del param._high_precision_init_val

    build = builder.build_model_chunks

    def build_keeping_init(cfg):
        chunks = build(cfg)
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if ".layers." in name and param.dim() == 2:
                    param._high_precision_init_val = param.detach().cpu().clone()
                    _RANDOM_INIT.append((param, param._high_precision_init_val.clone()))
                    param.get_high_precision_init_val = MethodType(get, param)
                    param.clear_high_precision_init_val = MethodType(clear, param)
        return chunks

    builder.build_model_chunks = build_keeping_init
    is_fp8, dequantize = distrib_optimizer.is_float8tensor, distrib_optimizer.dequantize_fp8_tensor
    emulated = lambda t: hasattr(t, "get_high_precision_init_val")  # noqa: E731
    distrib_optimizer.is_float8tensor = lambda t: emulated(t) or is_fp8(t)
    distrib_optimizer.dequantize_fp8_tensor = lambda t: t if emulated(t) else dequantize(t)


def _main_param_mismatches(overrides, emulate: bool):
    """(each rank) Build the trainer as a run does; the params whose fp32 main copy (this rank's shard under
    the distributed optimizer) is not the loaded weight, how many main params were compared, and how many
    emulated weights the load changed from their random init (of how many)."""
    import torch

    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import loop

    if emulate:
        _emulate_te_preserved_init()
    cfg = compose_recipe("tiny_llama_cpu", overrides)
    trainer = loop.Trainer(cfg, distributed.init_model_parallel(cfg))
    try:
        trainer.build()
        bad, compared = [], 0
        for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
            if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer: this rank's shards
                pairs = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
                shard = lambda p, o=opt: o._get_model_param_range_map(p)["param"]  # noqa: E731
            else:  # Float16OptimizerWithFloat16Params: whole fp32 copies
                pairs = zip(opt.float16_groups, opt.fp32_from_float16_groups)
                shard = None
            for model_group, main_group in pairs:
                for param, main in zip(model_group, main_group):
                    weight = param.detach().reshape(-1)
                    if shard is not None:
                        r = shard(param)
                        weight = weight[r.start:r.end]
                    compared += 1
                    if not torch.equal(main.reshape(-1), weight.float()):
                        bad.append(tuple(param.shape))
        loaded = sum(not torch.equal(param.detach().cpu(), init) for param, init in _RANDOM_INIT)
        return bad, compared, (loaded, len(_RANDOM_INIT))
    finally:
        trainer.close()
        distributed.shutdown()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, data_cache) -> Path:
    """Weights-only bf16 start weights from another seed than the runs' (so they differ from a fresh init)."""
    root = tmp_path_factory.mktemp("pretrained") / "checkpoints"
    return ts.initial_weights(root, data_cache, "parallel=none", "precision=bf16", "seed=4321")


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_main_params_are_the_loaded_weights_after_build(case, pretrained, data_cache, tmp_path):
    distributed_optimizer, emulate = CASES[case]
    overrides = [*ts.SMALL_DATA, *ts.FAST, f"data.cache_dir={data_cache}", f"run.dir={tmp_path / 'run'}",
                 "cluster.gpus_per_node=2", "cluster.nvlink_domain=2", "parallel=none", "precision=bf16",
                 f"optimizer.use_distributed_optimizer={str(distributed_optimizer).lower()}",
                 f"checkpoint.pretrained={pretrained.parent}", "checkpoint.load=none"]
    for rank, (bad, compared, (loaded, kept)) in enumerate(run_ranks(_main_param_mismatches, 2, overrides, emulate)):
        assert compared > 0, f"rank {rank}: no fp32 main params (is precision bf16?)"
        if emulate:  # the start weights are not the random init the emulated attribute keeps
            assert kept > 0 and loaded == kept, f"rank {rank}: the load changed {loaded} of {kept} emulated weights"
        assert bad == [], f"rank {rank}: fp32 main params not from the start weights, params of shapes {bad}"


def _fsdp_main_weight_mismatches(overrides):
    """(each rank) Build the trainer under Megatron-FSDP; the items whose fp32 main-weight shard is not this
    rank's shard of the model weight, and how many were compared."""
    import torch

    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import loop

    cfg = compose_recipe("tiny_llama_cpu", overrides)
    trainer = loop.Trainer(cfg, distributed.init_model_parallel(cfg))
    try:
        trainer.build()
        bad, compared = [], 0
        for chunk in trainer.model:
            for group in chunk.module.param_and_grad_buffer.parameter_groups:
                main, weights = group.main_weight_buffer, group.model_weight_buffer
                if main is None or weights is None:
                    continue
                for param in group.params:
                    item = weights.param_idx[param]
                    compared += 1
                    mine = main.get_item(item, only_shard=True)
                    if not torch.equal(mine, weights.get_item(item, only_shard=True).to(mine.dtype)):
                        bad.append(tuple(param.shape))
        return bad, compared
    finally:
        trainer.close()
        distributed.shutdown()


def test_megatron_fsdp_main_weights_are_the_loaded_weights_after_build(pretrained, data_cache, tmp_path):
    """Megatron-FSDP builds its main weights when it wraps the loaded model and has no re-read of them
    (megatron-core 0.19 raises NotImplementedError if asked): the trainer builds and its main weights are
    the start weights."""
    overrides = [*ts.SMALL_DATA, *ts.FAST, f"data.cache_dir={data_cache}", f"run.dir={tmp_path / 'run'}",
                 "cluster.gpus_per_node=2", "cluster.nvlink_domain=2", "parallel=none", "precision=bf16",
                 "parallel.fsdp=true", "parallel.sharding=zero3",
                 f"checkpoint.pretrained={pretrained.parent}", "checkpoint.load=none"]
    for rank, (bad, compared) in enumerate(run_ranks(_fsdp_main_weight_mismatches, 2, overrides)):
        assert compared > 0, f"rank {rank}: no Megatron-FSDP main weights (is precision bf16?)"
        assert bad == [], f"rank {rank}: main weights not this rank's shard of the start weights, shapes {bad}"
