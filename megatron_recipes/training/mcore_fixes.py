"""Work-arounds for megatron-core 0.16 bugs on its plain-torch optimizer path (no Apex, no TE).

Without Apex/Transformer Engine (always the case on the CPU lane), megatron-core wraps
``torch.optim.Adam``/``AdamW``, whose per-parameter ``step`` lives in the optimizer state. Two places
of the distributed optimizer do not expect that:

1. ``DistributedOptimizer.state_dict()`` collects every parameter's ``step`` and asserts there is one;
   a fresh optimizer has none yet, so *loading* a checkpoint into it fails. We allocate the state up
   front (zeros, step 0): exactly what torch's first step would create, so numerics do not change.
2. ``load_parameter_state_from_fully_reshardable`` hands ``_set_main_param_and_optimizer_states``
   tensors without ``step`` (it restores ``step`` separately from the param groups), and that method
   copies every key of the live state, ``step`` included: ``KeyError: 'step'``. We keep the ``step``
   that ``load_state_dict`` has just restored.

3. For SGD, ``get_megatron_optimizer`` sets ``init_state_fn = None``, but loading a checkpoint calls it
   (``sharded_state_dict(is_loading=True)``): ``TypeError: 'NoneType' object is not callable``, so an
   SGD run could not resume (nor requeue after preemption). We give it one that creates the momentum
   buffers the checkpoint then overwrites (zeros: with dampening 0, torch's first-step ``clone(grad)``
   equals ``momentum * 0 + grad``; with momentum 0 torch keeps no state at all).

All are applied by ``training.optim.build_optimizer``; each is a no-op where the bug cannot occur.
"""

from __future__ import annotations

import torch

_PATCHED = False


def allocate_torch_adam_state(optimizer) -> None:
    """Fix 1: give a fresh torch Adam its state now (zeros, step 0)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for part in parts:
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def keep_step_on_reshardable_load() -> None:
    """Fix 2 (idempotent): tolerate the missing ``step`` when loading a fully reshardable optimizer."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors and isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    _PATCHED = True


def _init_sgd_state(opt, config=None) -> None:
    for group in opt.param_groups:
        if not group.get("momentum"):
            continue
        for param in group["params"]:
            state = opt.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def sgd_state_for_loading(optimizer) -> None:
    """Fix 3: an ``init_state_fn`` for megatron-core's SGD, which has none."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(getattr(part, "optimizer", None), torch.optim.SGD) and getattr(part, "init_state_fn", 0) is None:
            part.init_state_fn = _init_sgd_state
