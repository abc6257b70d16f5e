"""The ``TransformerConfig`` hooks megatron-core's schedules call are set as Megatron-LM's training.py sets them.

Why: megatron-core reads ``grad_scale_func``, ``no_sync_func``, ``grad_sync_func``, ``param_sync_func`` and
``finalize_model_grads_func`` from the model config and trains silently wrong when one is missing or extra
(issue 24, finding 5: without ``grad_scale_func`` fp16's loss was never scaled while its DynamicGradScaler
divided the gradients by 2**32). Megatron-LM's rule, from its own arguments (training.py, before the loop):

- ``grad_scale_func``: the optimizer's ``scale_loss``, always;
- ``no_sync_func`` and ``grad_sync_func``: each chunk's ``no_sync`` / ``start_grad_sync`` with
  ``overlap_grad_reduce`` (``align_grad_reduce`` defaults on), else unset;
- ``param_sync_func``: each chunk's ``start_param_sync`` with ``overlap_param_gather`` under the interleaved
  schedule (``align_param_gather`` is switched off without VPP), else unset;
- ``finalize_model_grads_func``: megatron-core's ``finalize_model_grads``;
- one chunk: the bare function; several: one per chunk.

Every precision x wrapper (megatron DDP, Megatron-FSDP zero1/zero3) x overlap setting x VPP is built through
the trainer's own ``Trainer.build`` on the CPU lane and each hook compared, as the bound method it must be,
with that rule.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

import train_support as ts
from multiproc import run_ranks

pytestmark = pytest.mark.slow

PRECISIONS = ("fp32", "bf16", "fp16")
# overlap settings: (overlap_grad_reduce, overlap_param_gather); the parameter gather needs the other
OVERLAPS = {"none": (False, False), "grad": (True, False), "grad_param": (True, True)}
WRAPPERS = {  # name: (ranks, overrides)
    "ddp": (1, ["parallel=none"]),
    "ddp_pp2_vpp2": (2, ["parallel=pp2", "parallel.vpp=2"]),
    "fsdp_zero1": (1, ["parallel=none", "parallel.fsdp=true", "parallel.sharding=zero1"]),
    "fsdp_zero3": (1, ["parallel=none", "parallel.fsdp=true", "parallel.sharding=zero3"]),
}
HOOKS = ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func")


def _overrides(precision: str, overlap: str) -> List[str]:
    grad, param = OVERLAPS[overlap]
    return [
        f"precision.params_dtype={precision}",
        f"parallel.overlap_grad_reduce={str(grad).lower()}",
        f"parallel.overlap_param_gather={str(param).lower()}",
        "optimizer.use_distributed_optimizer=true",
    ]


def _describe(func, model, optimizer):
    """What a hook is, by identity: which object's bound method (a list: one per chunk)."""
    from megatron.core.distributed import finalize_model_grads

    if func is None:
        return None
    if isinstance(func, list):
        return [_describe(f, model, optimizer) for f in func]
    if func == optimizer.scale_loss:
        return "optimizer.scale_loss"
    if func is finalize_model_grads:
        return "finalize_model_grads"
    for i, chunk in enumerate(model):
        for name in ("no_sync", "start_grad_sync", "start_param_sync"):
            if func == getattr(chunk, name):
                return f"chunk{i}.{name}"
    return repr(func)


def _built_hooks(run_dir: str, cache: str, wrapper: str, world: int) -> Dict[str, dict]:
    """(rank) Every precision x overlap case of one wrapper, built by the trainer: its hooks and loss scale."""
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import loop

    out = {}
    for precision in PRECISIONS:
        for overlap in OVERLAPS:
            name = f"{precision}-{overlap}"
            cfg = compose_recipe("tiny_llama_cpu", [
                f"run.dir={run_dir}/{wrapper}-{name}", f"data.cache_dir={cache}", f"cluster.gpus_per_node={world}",
                f"cluster.nvlink_domain={world}", *ts.SMALL_DATA, *ts.FAST, *WRAPPERS[wrapper][1],
                *_overrides(precision, overlap),
            ])
            trainer = loop.Trainer(cfg, distributed.init_model_parallel(cfg))
            try:
                trainer.build()
                config = trainer.model[0].config
                out[name] = {hook: _describe(getattr(config, hook), trainer.model, trainer.optimizer) for hook in HOOKS}
                out[name]["loss_scale"] = float(trainer.optimizer.get_loss_scale())
                out[name]["chunks"] = len(trainer.model)
                out[name]["shared_config"] = all(chunk.config is config for chunk in trainer.model)
            finally:
                trainer.close()
    return out


def megatron_lm_rule(overlap: str, vpp: bool, chunks: int) -> Dict[str, object]:
    """The hooks Megatron-LM's training.py sets for these settings (see the module docstring)."""
    grad, param = OVERLAPS[overlap]

    def per_chunk(method: str):
        names = [f"chunk{i}.{method}" for i in range(chunks)]
        return names[0] if chunks == 1 else names

    return {
        "grad_scale_func": "optimizer.scale_loss",
        "no_sync_func": per_chunk("no_sync") if grad else None,
        "grad_sync_func": per_chunk("start_grad_sync") if grad else None,
        "param_sync_func": per_chunk("start_param_sync") if param and vpp else None,
        "finalize_model_grads_func": "finalize_model_grads",
    }


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_schedule_hooks_follow_megatron_lm(tmp_path, cache, wrapper):
    world, _ = WRAPPERS[wrapper]
    vpp = "vpp" in wrapper
    per_rank = run_ranks(_built_hooks, world, str(tmp_path), str(cache), wrapper, world, timeout=900)
    for rank, cases in enumerate(per_rank):
        assert set(cases) == {f"{p}-{o}" for p in PRECISIONS for o in OVERLAPS}
        for name, seen in cases.items():
            precision, overlap = name.split("-")
            assert seen["chunks"] == (2 if vpp else 1) and seen["shared_config"], (rank, name, seen)
            want = megatron_lm_rule(overlap, vpp, seen["chunks"])
            assert {hook: seen[hook] for hook in HOOKS} == want, f"rank {rank}, {wrapper}, {name}"
            # the scale the schedule multiplies each loss by: fp16's dynamic scaler starts at 2**32
            assert seen["loss_scale"] == (2.0**32 if precision == "fp16" else 1.0), (rank, name)
