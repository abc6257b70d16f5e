"""Checkpoints: the one owner of what a checkpoint holds, where it lives, and what a run starts from.

``training/``, ``convert/``, ``peft/``, ``check/`` and ``report/`` use only the names below; the modules
behind them are private (tests/test_package_imports.py enforces it):

- ``_files``      the on-disk layout: iteration folders, completion marker, tracker, retention, meta.json
- ``_identity``   what a checkpoint is *of*: model fingerprint and the layout it was saved with
- ``_mcore``      megatron-core distributed checkpointing (torch_dist), RNG streams, optimizer state
- ``_trust``      loading never runs code from a checkpoint unless the user trusts it
- ``_adapters``   checkpoints of models with adapters hold the trainable tensors only
- ``_fsdp``       Megatron-FSDP runs' checkpoints (megatron-core's fsdp_dtensor format), behind save/load
- ``_save_load``  one checkpoint saved or loaded collectively, in any layout
- ``_checksums``  every file's size and hash, recorded at save and verified at load
- ``_async``      saves written in the background (checkpoint.async_save), one in flight at a time
- ``_start``      what a training run starts from (resume, pretrained/base/seed weights)
- ``_run_identity`` what a resume must match beyond the model (tokenizer, PEFT and its base, data)
- ``_foreign``    Megatron-LM and Megatron-Bridge checkpoints described in our terms (read), and what
                  Megatron-LM's ``load_checkpoint`` needs in ours (written)

The folder-level names import no torch (``megatron-recipes report`` reads checkpoint folders); the rest
load on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

from megatron_recipes.checkpoint._files import (
    CHECKPOINTS,
    HF_ASSETS,
    TRACKER,
    SavedRun,
    checkpoints_root,
    clean_leftovers,
    hf_assets_beside,
    is_complete,
    iter_dir,
    latest,
    prepare_staging,
    read_meta,
    read_run,
    require_writable,
    step_of,
)
from megatron_recipes.checkpoint._files import resolve_dir as resolve
from megatron_recipes.checkpoint._identity import check_same_model
from megatron_recipes.checkpoint._formats import choose as optimizer_format_for
from megatron_recipes.checkpoint._run_identity import KEY as IDENTITY_KEY
from megatron_recipes.checkpoint._run_identity import run_identity

if TYPE_CHECKING:
    from megatron_recipes.checkpoint._adapters import AdapterModule
    from megatron_recipes.checkpoint._async import BackgroundSaves
    from megatron_recipes.checkpoint._async import enabled as async_enabled
    from megatron_recipes.checkpoint._mcore import root_cause
    from megatron_recipes.checkpoint._save_load import (
        finish_weights_only,
        load,
        load_weights,
        on_rank0,
        save,
        verify_files,
        weights_state,
    )
    from megatron_recipes.checkpoint._start import Start, start_of
    from megatron_recipes.checkpoint._trust import TRUST_ENV, UntrustedCheckpoint, restricted_loading

_NEEDS_TORCH = {
    "AdapterModule": "_adapters",
    "BackgroundSaves": "_async",
    "async_enabled": ("_async", "enabled"),
    "root_cause": "_mcore",
    "finish_weights_only": "_save_load",
    "load": "_save_load",
    "load_weights": "_save_load",
    "on_rank0": "_save_load",
    "save": "_save_load",
    "verify_files": "_save_load",
    "weights_state": "_save_load",
    "Start": "_start",
    "start_of": "_start",
    "TRUST_ENV": "_trust",
    "UntrustedCheckpoint": "_trust",
    "restricted_loading": "_trust",
}


def __getattr__(name: str) -> Any:
    """The names that need torch, imported when first used (PEP 562)."""
    if name not in _NEEDS_TORCH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    module, attr = _NEEDS_TORCH[name] if isinstance(_NEEDS_TORCH[name], tuple) else (_NEEDS_TORCH[name], name)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


__all__ = [
    "AdapterModule",
    "BackgroundSaves",
    "CHECKPOINTS",
    "HF_ASSETS",
    "SavedRun",
    "Start",
    "TRACKER",
    "TRUST_ENV",
    "UntrustedCheckpoint",
    "async_enabled",
    "check_same_model",
    "optimizer_format_for",
    "checkpoints_root",
    "clean_leftovers",
    "hf_assets_beside",
    "finish_weights_only",
    "is_complete",
    "iter_dir",
    "latest",
    "load",
    "load_weights",
    "on_rank0",
    "prepare_staging",
    "read_meta",
    "read_run",
    "resolve",
    "require_writable",
    "restricted_loading",
    "root_cause",
    "run_identity",
    "IDENTITY_KEY",
    "save",
    "start_of",
    "step_of",
    "verify_files",
    "weights_state",
]
