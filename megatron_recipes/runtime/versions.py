"""The software stack a run uses (megatron-core, Transformer Engine, torch, CUDA), for the run log.

A result is only comparable with the versions that produced it: every run prints and records these, and
the image build prints them (``python -m megatron_recipes.runtime.versions``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Dict


def _dist(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def stack() -> Dict[str, str]:
    """``{"megatron-core": ..., "transformer-engine": ..., "torch": ..., "cuda": ...}``."""
    import torch

    te = "absent"
    try:
        import transformer_engine

        te = str(getattr(transformer_engine, "__version__", None) or _dist("transformer-engine"))
    except Exception:  # not installed, or installed without a working build: both mean "not used"
        te = "absent" if _dist("transformer-engine") == "absent" else f"{_dist('transformer-engine')} (does not import)"
    return {
        "megatron-core": _dist("megatron-core"),
        "transformer-engine": te,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
    }


_STACK_FIRST = ("megatron-core", "transformer-engine", "torch", "cuda")


def describe(versions: Dict[str, str]) -> str:
    """One line, the training stack first: that is what a user comparing two runs' logs looks for."""
    order = [k for k in _STACK_FIRST if k in versions] + [k for k in versions if k not in _STACK_FIRST]
    return ", ".join(f"{k} {versions[k]}" for k in order)


if __name__ == "__main__":
    print(describe(stack()))
