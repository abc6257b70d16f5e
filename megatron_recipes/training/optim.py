"""Model wrapping, optimizer and LR schedule: the recipe's settings through megatron-core's own classes.

DDP (``DistributedDataParallelConfig``), ``get_megatron_optimizer`` (Adam or SGD, optionally the
distributed optimizer) and ``OptimizerParamScheduler`` do the work; this module only maps recipe fields
onto them, in one place (the trainer and the checkpoint tests build their state through it).
"""

from __future__ import annotations

import math
from typing import List

import torch

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.models.transformer_config import params_dtype
from megatron_recipes.runtime import patches

# parallel.sharding -> Megatron-FSDP's DistributedDataParallelConfig.data_parallel_sharding_strategy
# ('optim' | 'optim_grads' | 'optim_grads_params', megatron-core 0.16 distributed_data_parallel_config.py).
FSDP_STRATEGY = {"zero1": "optim", "zero2": "optim_grads", "zero3": "optim_grads_params"}


def ddp_config(cfg: RunConfig):
    """RunConfig -> megatron-core ``DistributedDataParallelConfig`` (the one place DP settings map).

    - ``optimizer.use_distributed_optimizer`` -> ``use_distributed_optimizer`` (ZeRO-1 on megatron DDP).
    - ``parallel.fsdp`` -> ``use_megatron_fsdp``; ``parallel.sharding`` -> ``data_parallel_sharding_strategy``
      (FSDP_STRATEGY). Without FSDP, megatron DDP shards only optimizer state (its grad buffer and params
      stay whole), so rules allow zero2/zero3 only with ``parallel.fsdp=true``.
    - ``parallel.dist_optimizer_instances`` -> ``num_distributed_optimizer_instances``: the DP group is
      split into that many replicas, each sharding state over DP / instances ranks (megatron-core creates
      the intra/inter groups in ``initialize_model_parallel``, which runtime/distributed.py also passes it).
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    p = cfg.parallel
    fsdp = {}
    if p.fsdp:
        fsdp = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=FSDP_STRATEGY[p.sharding])
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.precision.grad_reduce_in_fp32,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        num_distributed_optimizer_instances=p.dist_optimizer_instances,
        # Under the interleaved schedule the schedule itself dispatches each chunk's parameter all-gather
        # (config.param_sync_func, installed below); the forward pre-hooks must then only wait for them,
        # which is what align_param_gather tells megatron-core's DDP. Without VPP the hooks dispatch.
        align_param_gather=_schedule_dispatches_param_gather(cfg),
        average_in_collective=False,  # per-token loss: finalize_model_grads divides by the token count
        # FP8 parameters: megatron DDP and Megatron-FSDP size and gather their buffers by it (Megatron-LM
        # passes the same flag to both configs).
        fp8_param_gather=cfg.precision.fp8_param_gather,
        reuse_grad_buf_for_mxfp8_param_ag=reuse_grad_buffer_for_mxfp8(cfg),
        # Deferred weight gradients (Transformer Engine's delay_wgrad_compute) reach the buffer only in
        # backward_dw(): DDP must then take their reduction hook from the module, not from the parameter's
        # gradient accumulator, or it reduces before they exist (Megatron-LM passes the same flag to both)
        delay_wgrad_compute=p.delay_wgrad_compute,
        **fsdp,
    )


def reuse_grad_buffer_for_mxfp8(cfg: RunConfig) -> bool:
    """MXFP8 parameters gathered in FP8 under megatron DDP's distributed optimizer: megatron-core always lays
    the param buffer over the grad buffer there, and without this flag it remaps each MXFP8 parameter into it
    through TE's ``replace_raw_data``, which MXFP8 tensors refuse (a crash at wrapping, megatron-core 0.16
    param_and_grad_buffer.py). Megatron-LM leaves the flag to the user and turns it off under Megatron-FSDP,
    which keeps its own buffers; here it follows from the recipe."""
    prec = cfg.precision
    return bool(prec.fp8 and prec.fp8_recipe == "mxfp8" and prec.fp8_param_gather
                and cfg.optimizer.use_distributed_optimizer and not cfg.parallel.fsdp)


def refresh_shared_param_buffer(cfg: RunConfig, optimizer) -> None:
    """After the grad buffers were zeroed: put the main params back into the MXFP8 param buffer they share
    (``reuse_grad_buffer_for_mxfp8`` with ``overlap_param_gather``, whose deferred all-gathers read it in
    the next forward), as Megatron-LM's train_step does; a no-op otherwise."""
    if not (reuse_grad_buffer_for_mxfp8(cfg) and cfg.parallel.overlap_param_gather):
        return
    from megatron.core.optimizer import DistributedOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, DistributedOptimizer):
            part._copy_main_params_to_param_buffer()


def wrap_model(cfg: RunConfig, chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """Float16Module (bf16/fp16, as Megatron-LM does) and megatron-core DDP (or Megatron-FSDP's
    ``FullyShardedDataParallel``, which replaces it as in Megatron-LM) around each model chunk."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp = ddp_config(cfg)
    wrapper = DistributedDataParallel
    if ddp.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel as wrapper

        patches.apply("fsdp")  # its reduction of unsharded grad buffers (runtime/patches/)
    # As Megatron-LM: only the first chunk buckets its grads; later VPP chunks' reduction overlaps with
    # the remaining compute anyway.
    return [
        wrapper(config=config, ddp_config=ddp, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def _schedule_dispatches_param_gather(cfg: RunConfig) -> bool:
    p = cfg.parallel
    return bool(p.overlap_param_gather and cfg.optimizer.use_distributed_optimizer and p.vpp)


def configure_schedule_hooks(cfg: RunConfig, model: List[torch.nn.Module], optimizer) -> None:
    """The ``TransformerConfig`` hooks megatron-core's schedules call, by Megatron-LM's rule (training.py,
    just before its training loop), read from the recipe's settings as Megatron-LM reads its arguments
    (not from a ddp_config that Megatron-FSDP has since changed):

    - ``grad_scale_func = optimizer.scale_loss``, always: the schedule scales each microbatch's loss by it
      before backward and the optimizer divides the gradients by the same scale. Under fp16 that scale is
      the DynamicGradScaler's (2**32 at the start): without the hook the updates come out that much too
      small and nothing fails. fp32/bf16: the scale is 1.
    - ``no_sync_func`` and ``grad_sync_func`` only with ``parallel.overlap_grad_reduce``; Megatron-LM's
      ``align_grad_reduce`` has no switch here and keeps its default (on), so grad_sync_func comes with it.
    - ``param_sync_func`` only with ``overlap_param_gather`` under VPP: Megatron-LM switches its
      ``align_param_gather`` off without the interleaved schedule (the only one that calls it).
    - ``finalize_model_grads_func``: megatron-core's ``finalize_model_grads``.
    One chunk gets the bare function, several a list (the interleaved schedule indexes it per chunk).
    Call after ``build_optimizer``: the optimizer owns the loss scale.
    """
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(name: str):
        funcs = [getattr(chunk, name) for chunk in model]
        return funcs[0] if len(funcs) == 1 else funcs

    p = cfg.parallel
    config = model[0].config
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    if p.overlap_grad_reduce:
        config.no_sync_func = per_chunk("no_sync")
        config.grad_sync_func = per_chunk("start_grad_sync")
    if p.overlap_param_gather and p.vpp:
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


def finish_param_sync(model: List[torch.nn.Module]) -> None:
    """Complete the parameter all-gathers that megatron DDP's ``overlap_param_gather`` defers to the next
    forward; call before an evaluation, a save or an export (a no-op without the overlap).

    With the overlap, ``optimizer.step()`` updates only this rank's shard and the other ranks' shards arrive
    in the next forward's pre-hooks, so a save or an evaluation in between would read the previous step's
    copy of them. Megatron-LM's rule (``should_disable_forward_pre_hook``): only megatron DDP with the
    distributed optimizer. Before a save it forces the gathers as here; around an evaluation it also takes
    the forward pre-hooks off and puts them back. That toggle is not mirrored: after a forced gather every
    bucket group counts as dispatched with nothing pending, so the hooks find nothing to wait for or to
    dispatch, and the interleaved schedule drops ``param_sync_func`` for forward-only passes.

    Not under Megatron-FSDP (as Megatron-LM): there each unit's forward gathers its own parameters and frees
    them after, and a save reads the shards; zero3 sets ``overlap_param_gather`` itself, and a forced sync
    would gather every bucket and keep it, i.e. the whole unsharded model on each rank.
    """
    for chunk in model:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is None or ddp.use_megatron_fsdp:
            continue
        if ddp.use_distributed_optimizer and ddp.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def optimizer_config(cfg: RunConfig):
    """RunConfig -> megatron-core ``OptimizerConfig`` (``optimizer.cpu_offload``/``offload_fraction`` ->
    ``optimizer_cpu_offload``/``optimizer_offload_fraction``).

    ``optimizer.clip_grad=0`` means "do not clip"; the norm is still computed (max norm = inf) so every
    step can log it.
    """
    from megatron.core.optimizer import OptimizerConfig

    from megatron_recipes.validation.validate import require

    require(cfg, "optimizer.name", "optimizer.distributed_needs_adam")
    o, prec = cfg.optimizer, cfg.precision
    return OptimizerConfig(
        optimizer=o.name,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad if o.clip_grad > 0 else math.inf,
        bf16=prec.params_dtype == "bf16",
        fp16=prec.params_dtype == "fp16",
        params_dtype=params_dtype(cfg),
        use_distributed_optimizer=o.use_distributed_optimizer,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        # megatron-core 0.16 optimizer_config.py: HybridDeviceOptimizer keeps optimizer_offload_fraction of
        # the (sharded) fp32 state and its step on the host; AdamW mode (decoupled_weight_decay) required.
        optimizer_cpu_offload=o.cpu_offload,
        optimizer_offload_fraction=o.offload_fraction if o.cpu_offload else 0.0,
        # Megatron-LM requires it with optimizer_cpu_offload: HybridDeviceOptimizer reuses that code path
        # (its __post_init__ then skips the TE FusedAdam check; constructing it still asks TE's version)
        use_precision_aware_optimizer=o.cpu_offload,
        reuse_grad_buf_for_mxfp8_param_ag=reuse_grad_buffer_for_mxfp8(cfg),
    )


def build_optimizer(cfg: RunConfig, model: List[torch.nn.Module]):
    from megatron.core.optimizer import get_megatron_optimizer

    optimizer = get_megatron_optimizer(optimizer_config(cfg), model)
    patches.apply("optimizer", optimizer)  # megatron-core's plain-torch optimizer path (runtime/patches/)
    return optimizer


def reload_main_params(cfg: RunConfig, optimizer) -> None:
    """Main params from the loaded start weights, as Megatron-LM's load_checkpoint does without optimizer
    state: under fp8_model_init TE keeps each weight's random init and the distributed optimizer builds its
    fp32 shards from it. Megatron-FSDP builds its main weights from the model when it wraps it, after the
    load, so there is nothing to re-read: megatron-core 0.16 returns there and 0.19 raises
    NotImplementedError. Without main params this is a no-op."""
    if cfg.parallel.fsdp:
        return
    optimizer.reload_model_params()


def build_scheduler(cfg: RunConfig, optimizer):
    """Warm-up then cosine/linear/constant decay, counted in optimizer steps (not samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_recipes.validation.validate import require

    require(cfg, "optimizer.schedule")
    o = cfg.optimizer
    warmup = derived.lr_warmup_iters(cfg)
    decay = max(derived.lr_decay_iters(cfg), warmup + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr if o.lr_decay_style != "constant" else o.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
