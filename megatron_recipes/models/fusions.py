"""Which of megatron-core's fused GPU kernels a run switches on, decided once from the recipe and machine.

``train.fusions.<name>``: ``null`` (default) turns a fusion on wherever this machine has its kernel and
the model can use it, off on the CPU lane; ``true`` requires it (a machine or model that cannot run it
is an error, never a silent downgrade); ``false`` turns it off. The decision is printed in the run log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

# recipe field -> megatron-core TransformerConfig field
FIELDS = {
    "gradient_accumulation": "gradient_accumulation_fusion",
    "rope": "apply_rope_fusion",
    "bias_dropout": "bias_dropout_fusion",
    "bias_activation": "bias_activation_fusion",
    "moe_permute": "moe_permute_fusion",
    "moe_router": "moe_router_fusion",
}


@dataclass(frozen=True)
class Kernels:
    """What this machine offers (``capabilities.detect`` fills it; tests describe a GPU machine)."""

    cuda: bool
    transformer_engine: bool  # the TE spec is used
    te_version: Tuple[int, ...] = ()
    apex_wgrad: bool = False  # apex's fused_weight_gradient_mlp_cuda (the local spec's wgrad fusion)


def _applies(cfg: RunConfig, name: str) -> Optional[str]:
    """Why the model cannot use this fusion (None when it can)."""
    m = cfg.model
    if name == "rope":
        if m.position_embedding_type != "rope":
            return f"model.position_embedding_type={m.position_embedding_type} has no rotary embedding"
        if m.multi_latent_attention:
            return "megatron-core's fused RoPE for multi-latent attention is experimental (training only)"
    if name == "bias_activation":
        if m.activation == "swiglu":
            return None
        if m.activation == "gelu" and m.add_bias_linear:
            return None
        return (
            f"model.activation={m.activation} with add_bias_linear={m.add_bias_linear}: megatron-core fuses "
            "bias+activation only for swiglu, or gelu with a bias"
        )
    if name in ("moe_permute", "moe_router") and not derived.is_moe(m):
        return "the model has no MoE layers"
    return None


def _kernel(k: Kernels, name: str) -> Optional[str]:
    """Why this machine lacks the kernel (None when it has it)."""
    if not k.cuda:
        return "no GPU (CPU lane)"
    if name == "gradient_accumulation" and not (k.transformer_engine or k.apex_wgrad):
        return "needs Transformer Engine or apex's fused_weight_gradient_mlp_cuda"
    if name == "rope" and not k.transformer_engine:
        return "needs Transformer Engine's fused RoPE"
    if name == "moe_permute" and not (k.transformer_engine and k.te_version >= (2, 1)):
        return "needs Transformer Engine >= 2.1"
    if name == "moe_router" and not (k.transformer_engine and k.te_version >= (2, 7)):
        return "needs Transformer Engine >= 2.7"
    return None


def decide(cfg: RunConfig, kernels: Kernels) -> Dict[str, bool]:
    """megatron-core field -> on/off; raises for a fusion the recipe requires but cannot have here."""
    out: Dict[str, bool] = {}
    problems: List[str] = []
    for name, mcore in FIELDS.items():
        wanted = getattr(cfg.train.fusions, name)
        why_not = _applies(cfg, name) or _kernel(kernels, name)
        if wanted and why_not:
            problems.append(f"train.fusions.{name}=true: {why_not}")
        out[mcore] = bool(why_not is None and wanted is not False)
    if problems:
        raise RecipeError(
            "fused kernels requested that this run cannot use:\n  - " + "\n  - ".join(problems),
            fix="set those train.fusions.<name> to null (on where available) or false",
        )
    return out


def describe(decided: Dict[str, bool]) -> str:
    on = [k for k, v in decided.items() if v]
    return "fusions on: " + (", ".join(on) if on else "none")
