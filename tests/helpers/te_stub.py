"""An import stub of ``transformer_engine`` for the TE structure tests only (never for training tests).

It lets megatron-core import its Transformer Engine extension on a machine without TE, so the TE layer
spec and a TransformerConfig with TE-only fusions can be built and validated exactly as on a GPU. Every
``transformer_engine.*`` module exists; every attribute is a placeholder class (CamelCase names, usable
as a base class) or a placeholder callable. Nothing here computes: the tests build specs and configs,
never run a TE layer. Install it in a fresh interpreter (a subprocess): megatron-core caches at import
time whether TE is present.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

VERSION = "2.9.0"


class _Placeholder:
    """Stands in for any TE class or object; subclassable, callable, attribute-rich."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __bool__(self):
        return True

    def __iter__(self):
        return iter(())


def _placeholder_class(name: str) -> type:
    import torch

    return type(name, (torch.nn.Module,), {"__init__": lambda self, *a, **k: torch.nn.Module.__init__(self)})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value = _placeholder_class(name) if name[:1].isupper() else _Placeholder()
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = VERSION
        return module

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def install() -> None:
    """Make ``import transformer_engine...`` succeed in this interpreter (call before megatron imports)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
