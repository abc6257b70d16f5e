"""A module imported on first use (the ``defer-wandb-import`` row of runtime/patches/)."""

from __future__ import annotations

import importlib
import sys
import threading
import types


class DeferredModule(types.ModuleType):
    """Stands in ``sys.modules`` for an installed module until one of its attributes is read, then imports
    it (replacing itself there) and forwards every read. Unlike ``importlib.util.LazyLoader``, reading the
    import system's own attributes (``__spec__``, ``__file__``, ...) does not import it: every ``import``
    statement reads ``__spec__``, so a LazyLoader module is loaded by megatron-core's ``import wandb``."""

    def __init__(self, spec) -> None:
        super().__init__(spec.name)
        self.__spec__, self.__loader__, self.__file__ = spec, spec.loader, spec.origin
        self.__package__ = spec.parent if spec.submodule_search_locations is None else spec.name
        self.__dict__["_deferred_lock"] = threading.Lock()

    def _deferred_real(self):
        with self.__dict__["_deferred_lock"]:
            real = self.__dict__.get("_deferred_module")
            if real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                real = importlib.import_module(self.__name__)
                self.__dict__["_deferred_module"] = real
            return real

    def __getattr__(self, name: str):  # only names not set above: the module's own
        return getattr(self._deferred_real(), name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("__") and "_deferred_module" not in self.__dict__:
            super().__setattr__(name, value)
        else:
            setattr(self._deferred_real(), name, value)
