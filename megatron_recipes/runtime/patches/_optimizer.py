"""Rows of scope ``optimizer``: megatron-core's plain-torch optimizer path (no Apex, no TE).

Each ``_fix`` / ``_defect`` pair is one row of the table in ``runtime/patches/__init__.py``.
"""

from __future__ import annotations

import inspect

import torch



# --- optimizer: megatron-core's plain-torch optimizer path (no Apex, no TE) ---------------------


def _allocate_torch_adam_state(optimizer) -> None:
    """Give a fresh torch Adam its state now (zeros, step 0): what its first step creates, so numerics
    do not change, and ``DistributedOptimizer.state_dict()`` (which asserts a ``step``) can load."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
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


def _state_dict_asserts_step() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.state_dict)
    return "step" in source and "assert" in source


_SIBLING_STEP = "__megatron_recipes_sibling_step__"


def _step_from_siblings(optimizer) -> None:
    """A chained optimizer with no parameter on this rank (the expert optimizer of a pipeline stage whose
    layers are all dense) has no Adam state, so ``DistributedOptimizer.state_dict()`` finds no step and
    asserts. Rank 0 writes the common state for every rank, so the step it writes must be the true one:
    the step of a sibling optimizer on this rank (all parts of a chain step together)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]

    def sibling_step():
        for part in parts:
            for state in getattr(getattr(part, "optimizer", None), "state", {}).values():
                if isinstance(state, dict) and torch.is_tensor(state.get("step")):
                    return state["step"].clone()
        return torch.tensor(0.0)  # no part holds state: nothing has stepped yet

    for part in parts:
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or any(g["params"] for g in inner.param_groups):
            continue
        if getattr(part.state_dict, "_megatron_recipes_sibling_step", False):
            continue
        original = part.state_dict

        def state_dict(original=original, inner=inner):
            inner.state[_SIBLING_STEP] = {"step": sibling_step()}  # a non-tensor key: torch keeps it as is
            try:
                return original()
            finally:
                inner.state.pop(_SIBLING_STEP, None)

        state_dict._megatron_recipes_sibling_step = True
        part.state_dict = state_dict


def _empty_optimizer_asserts_step() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.state_dict)
    return "assert len(steps) == 1" in source


def _keep_step_on_reshardable_load(optimizer=None) -> None:
    """``load_parameter_state_from_fully_reshardable`` passes tensors without ``step`` and the setter copies
    every key of the live state: ``KeyError: 'step'``. Keep the ``step`` ``load_state_dict`` restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_megatron_recipes_keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        if "step" not in tensors and isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    set_states._megatron_recipes_keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _setter_copies_every_key() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    setter = DistributedOptimizer._set_main_param_and_optimizer_states
    return not getattr(setter, "_megatron_recipes_keeps_step", False) and '"step"' not in inspect.getsource(setter)


def _init_sgd_state(opt, config=None) -> None:
    for group in opt.param_groups:
        if not group.get("momentum"):
            continue
        for param in group["params"]:
            state = opt.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _sgd_state_for_loading(optimizer) -> None:
    """Zero momentum buffers the checkpoint then overwrites (with dampening 0, torch's first-step
    ``clone(grad)`` equals ``momentum * 0 + grad``; with momentum 0 torch keeps no state at all)."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(getattr(part, "optimizer", None), torch.optim.SGD) and getattr(part, "init_state_fn", 0) is None:
            part.init_state_fn = _init_sgd_state


def _sgd_has_no_init_state_fn() -> bool:
    from megatron.core import optimizer as mcore_optimizer

    source = inspect.getsource(mcore_optimizer)
    return "init_state_fn = None" in source
