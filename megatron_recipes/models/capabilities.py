"""What this machine can honour (Transformer Engine, DeepEP, GPU), checked against a recipe.

The static recipe rules (config/rules) judge a recipe against the cluster it declares; these checks
judge it against the machine it is actually running on. A setting that cannot be honoured here is an
error, never a silent downgrade (a run that trains something other than its recipe is worse than none).
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
    return Machine(cuda=cuda, transformer_engine=te, deep_ep=deep_ep, compute_capability=cc)


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
    """Human-readable reasons this machine cannot run the recipe as written (empty if it can)."""
    m = machine or detect()
    p, prec = cfg.parallel, cfg.precision
    problems: List[str] = []
    te = m.transformer_engine and m.cuda
    where = "this machine has no GPU" if not m.cuda else "Transformer Engine is not importable here"
    if prec.fp8 and not te:
        problems.append(f"precision.fp8={prec.fp8} needs Transformer Engine on a GPU, but {where}; use precision=bf16 (or fp32 on CPU)")
    if prec.fp4 and not te:
        problems.append(f"precision.fp4={prec.fp4} needs Transformer Engine on a Blackwell GPU, but {where}; use precision=bf16")
    if p.cp > 1 and not te and p.cp_comm_type != "all_gather":
        problems.append(
            f"parallel.cp={p.cp} with cp_comm_type={p.cp_comm_type} needs Transformer Engine's attention, but {where}; "
            "the local spec's CP attention all-gathers keys/values: use parallel.cp_comm_type=all_gather"
        )
    if te:
        from megatron_recipes.config.rules_data import packed_thd_needs_mbs1

        thd = packed_thd_needs_mbs1(cfg)
        if thd:
            problems.append(f"{thd}; set train.micro_batch_size=1 (raise train.seq_length to pack more) or data.packing=false")
    if p.moe_dispatcher == "flex" and not m.deep_ep:
        problems.append("parallel.moe_dispatcher=flex needs DeepEP (deep_ep) on a GPU, which is not importable here; use parallel.moe_dispatcher=alltoall")
    if cfg.optimizer.cpu_offload and not te:  # HybridDeviceOptimizer runs on the precision-aware optimizer path
        problems.append(f"optimizer.cpu_offload needs a GPU and Transformer Engine, but {where}; set optimizer.cpu_offload=false")
    if cfg.train.activation_offload_layers > 0 and not te:  # TransformerBlock: get_cpu_offload_context is TE's
        problems.append(f"train.activation_offload_layers needs Transformer Engine on a GPU, but {where}; set it to 0")
    if prec.params_dtype == "fp16" and not m.cuda:
        problems.append("precision.params_dtype=fp16 is not supported on the CPU lane; use precision=fp32 or bf16")
    if prec.fp8 and m.cuda and m.compute_capability < (8, 9):
        problems.append(f"precision.fp8 needs compute capability >= 8.9 (Ada/Hopper), this GPU is {m.compute_capability}")
    if (prec.fp4 or prec.fp8_recipe == "mxfp8" and prec.fp8) and m.cuda and m.compute_capability < (10, 0):
        problems.append(f"MXFP8/NVFP4 need a Blackwell GPU (compute capability >= 10.0), this GPU is {m.compute_capability}")
    return problems


def require_supported(cfg: RunConfig, machine: Machine | None = None) -> None:
    from megatron_recipes.models import fusions

    fusions.decide(cfg, kernels(machine))  # a required fusion this machine lacks is an error too
    problems = unmet_requirements(cfg, machine)
    if problems:
        raise RecipeError(
            "this machine cannot honour the recipe as written:\n  - " + "\n  - ".join(problems),
            fix="change the settings named above (nothing is downgraded silently)",
        )
