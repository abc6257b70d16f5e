"""Defer ``torch.compile``'s import of TorchDynamo/Inductor until a compiled function is first called.

megatron-core decorates its fusion kernels with ``torch.compile`` at import time, which pulls in
TorchDynamo and Inductor (about 3 s per process) even when no fused kernel ever runs, as on the CPU
lane. Every rank, test process and CLI call pays that. ``torch.compile`` is lazy anyway (it compiles
on the first call); this only moves the import of its machinery to that first call. Modules and other
non-function targets go straight to the real ``torch.compile``.

``install()`` does not import torch itself (so ``megatron-recipes --help`` stays instant): if torch is
not imported yet, the wrapper is put in place right after torch's own import finishes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
from types import ModuleType


def _wrap(torch: ModuleType) -> None:
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


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds torch the normal way, then wraps its loader so ``_wrap`` runs once torch is initialised."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_wrap(module: ModuleType) -> None:
            exec_module(module)
            _wrap(module)

        spec.loader.exec_module = exec_then_wrap
        return spec


def install() -> None:
    """Idempotent; wraps now if torch is imported, else right after torch is."""
    if "torch" in sys.modules:
        _wrap(sys.modules["torch"])
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())
