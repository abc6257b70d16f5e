"""Loading a checkpoint never runs code from it, unless the user says they trust it.

A torch_dist checkpoint holds three kinds of pickles (read from torch 2.13 and megatron-core 0.16.1):
- ``.metadata``: ``FileSystemReader.read_metadata`` calls plain ``pickle.load``, which calls whatever a
  crafted file names (``os.system``...). Every load, ``load_tensors_metadata`` and the converter read it.
- objects inside the ``.distcp`` files (RNG states, ``_extra_state``): ``DefaultLoadPlanner.load_bytes``
  calls ``torch.load(..., weights_only=False)``.
- ``common.pt`` (loop state, optimizer param groups): megatron-core's ``TorchCommonLoadStrategy`` calls
  ``torch.load`` without ``weights_only``, safe only while no ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set.

While ``restricted_loading()`` is active, ``.metadata`` goes through an unpickler that admits only the
classes the checkpoint index is made of, and every ``torch.load`` runs with ``weights_only=True``
(megatron-core registers the few extra classes its own files need as torch safe globals; a Megatron-LM
``args`` Namespace and the enums it holds are admitted too). Anything else
stops the load with one message naming the file. ``checkpoint.trust_code=true`` (training) or
``--trust-checkpoint`` (convert) lifts both for checkpoints the user made or trusts.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import pickle
import types
from typing import Any, Iterator, Optional

import torch

from megatron_recipes.config.errors import RecipeError

TRUST_ENV = "MEGATRON_RECIPES_TRUST_CHECKPOINT_CODE"  # set by `convert --trust-checkpoint`
FIX = ("load only checkpoints you trust; if you do trust this one (your own, or from a source you trust), "
       "pass checkpoint.trust_code=true (train) or --trust-checkpoint (convert)")

# The classes a checkpoint index (.metadata) is built from: torch DCP's metadata/planner records and
# megatron-core's subclasses of them. Constructing these runs no user code.
_INDEX_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
    "megatron.core.dist_checkpointing.strategies.torch",
}
_EXTRA = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id of a path-given save
}


# A Megatron-LM checkpoint's common state carries the training command's arguments (``args``): an
# ``argparse.Namespace`` of plain values, torch dtypes, a ``signal.Signals`` and megatron-core's enums.
# Building those runs no code from the file (a Namespace is filled attribute by attribute, an enum is
# looked up by value), so a weights-only load admits exactly them.
_ARGS_ENUM_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums")


def _args_globals() -> list:
    import argparse
    import importlib
    import signal

    admitted: list = [argparse.Namespace, signal.Signals]
    for name in _ARGS_ENUM_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        admitted += [obj for obj in vars(module).values()
                     if isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__module__ == name]
    return admitted


class UntrustedCheckpoint(RecipeError):
    """A checkpoint file asked to build an object that loading it safely cannot allow."""


def _admitted(module: str, name: str) -> bool:
    if "." in name or name.startswith("__"):
        return False
    if (module, name) in _EXTRA:
        return True
    if module == "torch":  # dtypes and memory formats (torch.float32, torch.contiguous_format)
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout))
    if module in _INDEX_MODULES:
        obj = getattr(__import__(module, fromlist=[name]), name, None)
        return isinstance(obj, type) and obj.__module__ == module and (
            issubclass(obj, enum.Enum) or "__dataclass_fields__" in vars(obj) or not vars(obj).get("__init__"))
    return False


class IndexUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` for checkpoint indexes: only the record classes listed above."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise UntrustedCheckpoint(
                f"refusing to load '{self.where}': it asks to build {module}.{name}, which a checkpoint "
                "index never holds (unpickling it could run code from the file)",
                fix=FIX,
            )
        return super().find_class(module, name)


def _name_of(file: Any) -> str:
    name = getattr(file, "name", None) if not isinstance(file, (str, os.PathLike)) else file
    if isinstance(file, io.BytesIO) or name is None:
        return "an object stored in the checkpoint's .distcp files"
    return os.fspath(name)


def _restricted_pickle_module() -> types.ModuleType:
    """``pickle`` as torch DCP's filesystem reader sees it, with ``load`` restricted."""
    shim = types.ModuleType("pickle_restricted")
    shim.__dict__.update(pickle.__dict__)
    shim.load = lambda file, **kw: IndexUnpickler(file, _name_of(file)).load()
    return shim


def _weights_only_load(original):
    def load(f, *args, weights_only: Optional[bool] = None, **kwargs):  # noqa: ARG001 (always True here)
        try:
            return original(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            detail = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln),
                          str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            raise UntrustedCheckpoint(
                f"refusing to load '{_name_of(f)}': it holds something besides tensors and plain values "
                f"({detail}); unpickling it could run code from the file",
                fix=FIX,
            ) from None

    return load


def trusted(flag: bool = False) -> bool:
    """The user's explicit opt-out: the recipe flag, or the environment variable convert sets."""
    return bool(flag) or os.environ.get(TRUST_ENV, "") in ("1", "true", "yes")


@contextlib.contextmanager
def restricted_loading(trust: bool = False) -> Iterator[None]:
    """Load checkpoints inside this block without running code from them (see the module docstring)."""
    if trusted(trust):
        yield
        return
    from torch.distributed.checkpoint import filesystem

    saved_pickle, saved_load = filesystem.pickle, torch.load
    filesystem.pickle, torch.load = _restricted_pickle_module(), _weights_only_load(saved_load)
    try:
        with torch.serialization.safe_globals(_args_globals()):
            yield
    finally:
        filesystem.pickle, torch.load = saved_pickle, saved_load


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything behind it: causes, contexts, and the per-rank failures torch DCP wraps."""
    seen, stack = set(), [exc]
    while stack:
        item = stack.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack += [item.__cause__, item.__context__]
        for failure in (getattr(item, "failures", None) or {}).values():  # rank -> (exception, stack)
            stack.append(failure[0] if isinstance(failure, tuple) and failure else failure)


def find_refusal(exc: BaseException) -> Optional[UntrustedCheckpoint]:
    """Our refusal, if it is inside ``exc`` (torch DCP wraps per-rank failures in a CheckpointException)."""
    return next((e for e in causes(exc) if isinstance(e, UntrustedCheckpoint)), None)
