"""Process-wide rows (scope ``process``): imports megatron-core would make eagerly, made on first use.

Each ``_fix`` / ``_defect`` pair is one row of the table in ``runtime/patches/__init__.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import torch

from megatron_recipes.runtime.deferred_import import DeferredModule


# --- process: torch.compile deferred ------------------------------------------------------------


def _defer_torch_compile() -> None:
    """megatron-core decorates its fusion kernels with ``torch.compile`` at import time, which imports
    TorchDynamo/Inductor (~3 s per process) even when no fused kernel runs (the CPU lane). Compilation is
    lazy anyway; this only moves the import of its machinery to the first call of a compiled function."""
    original = torch.compile
    if getattr(original, "_megatron_recipes_deferred", False):
        return

    def deferred_compile(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...) with options
            return lambda fn: deferred_compile(fn, **kwargs)
        if not inspect.isfunction(model):
            return original(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = original(model, **kwargs)
            return compiled(*args, **kw)

        return call

    deferred_compile._megatron_recipes_deferred = True
    torch.compile = deferred_compile


def _compile_imports_dynamo() -> bool:
    import sys

    import megatron.core.models.gpt  # noqa: F401  (its fusions call torch.compile at import)

    return "torch._dynamo" in sys.modules


# --- process: wandb imported on first use ------------------------------------------------------


_DEFERRED = ("wandb",)


def _defer_wandb_import() -> None:
    """megatron-core imports ``wandb`` at import time where installed (``timers``, the inference context),
    ~1 s of CPU per process, though only a run with ``logging.wandb_project`` uses it. The module is
    imported on first use instead, by megatron-core or by our tracker (which then gets the real one)."""
    for name in _DEFERRED:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:  # not installed: megatron-core's own ``except ImportError`` still sees that
            sys.modules[name] = DeferredModule(spec)


def _mcore_import_loads_wandb() -> bool:
    """Importing the megatron-core modules every run imports leaves wandb's package code loaded."""
    import megatron.core.inference.contexts.dynamic_context  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.timers  # noqa: F401

    return "wandb.sdk" in sys.modules
