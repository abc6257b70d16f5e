"""What this machine offers (Transformer Engine, DeepEP, GPU, fused kernels), and the recipe against it.

Detection lives here; the judgement is the rule table's ``machine`` scope (validation/rules_machine.py),
run with the detected machine. A setting that cannot be honoured here is an error, never a silent
downgrade (a run that trains something other than its recipe is worse than none).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from typing import List

import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig


@dataclass(frozen=True)
class Machine:
    cuda: bool
    transformer_engine: bool
    deep_ep: bool
    compute_capability: tuple
    te_version: tuple = ()  # (major, minor) of the importable Transformer Engine; () without it or unread


@lru_cache(maxsize=1)
def detect() -> Machine:
    cuda = torch.cuda.is_available()
    te = False
    if cuda and importlib.util.find_spec("transformer_engine") is not None:
        try:
            import transformer_engine.pytorch  # noqa: F401

            te = True
        except Exception:  # a broken TE install is the same as none for our purposes
            te = False
    deep_ep = cuda and importlib.util.find_spec("deep_ep") is not None
    cc = torch.cuda.get_device_capability() if cuda else (0, 0)
    return Machine(cuda=cuda, transformer_engine=te, deep_ep=deep_ep, compute_capability=cc,
                   te_version=_te_version() if te else ())


def _te_version() -> tuple:
    from importlib.metadata import PackageNotFoundError, version

    import transformer_engine

    text = getattr(transformer_engine, "__version__", None)
    if text is None:
        try:
            text = version("transformer-engine")
        except PackageNotFoundError:
            return ()
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def kernels(machine: Machine | None = None):
    """The fused kernels this machine offers (models.fusions decides what a run switches on)."""
    from megatron_recipes.models.fusions import Kernels

    m = machine or detect()
    te = use_transformer_engine(m)
    apex = m.cuda and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    return Kernels(cuda=m.cuda, transformer_engine=te, te_version=_te_version() if te else (), apex_wgrad=apex)


def use_transformer_engine(machine: Machine | None = None) -> bool:
    """TE layer spec when TE imports and a GPU is present; the local spec otherwise."""
    machine = machine or detect()
    return machine.cuda and machine.transformer_engine


def unmet_requirements(cfg: RunConfig, machine: Machine | None = None) -> List[str]:
    """Why this machine cannot run the recipe as written (empty if it can): the rule table's machine rules."""
    from megatron_recipes.validation.rules import Host, select
    from megatron_recipes.validation.validate import validate

    host = Host(machine=machine or detect())
    return [v.message for v in validate(cfg, rules=select(("machine",)), host=host)]


def require_supported(cfg: RunConfig, machine: Machine | None = None) -> None:
    """Refuse a recipe this machine cannot honour: a required fused kernel it lacks, or a machine rule."""
    from megatron_recipes.validation.rules import Host, select
    from megatron_recipes.validation.validate import validate
    from megatron_recipes.models import fusions

    machine = machine or detect()
    fusions.decide(cfg, kernels(machine))  # a required fusion this machine lacks is an error too
    violations = validate(cfg, rules=select(("machine",)), host=Host(machine=machine))
    if violations:
        raise RecipeError(
            "this machine cannot honour the recipe as written:\n  - " + "\n  - ".join(v.render() for v in violations),
            fix="change the settings named above (nothing is downgraded silently)",
        )
