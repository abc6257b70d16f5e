"""Where an HF PEFT adapter's tensors go on a mixture-of-experts model under transformers 5.

transformers 5 keeps a MoE layer's routed experts as 3D parameters of one experts module (Mixtral,
Qwen3-MoE, DeepSeek-V3: ``gate_up_proj [E, 2I, H]`` with the gate rows first, ``down_proj [E, H, I]``),
filled from the per-expert checkpoint tensors (``experts.<e>.w1.weight`` ...) by its conversion mapping.
HF PEFT adapts a parameter through ``target_parameters`` (``lora.ParamWrapper``), and its LoRA on a 3D
parameter is one rank-r pair per expert: ``lora_A.weight [E*r, in]`` holds ``A_e`` in rows ``e*r .. e*r+r-1``,
``lora_B.weight [out, r*E]`` holds ``B_e`` in columns ``i*E + e``, and ``W_e' = W_e + s B_e A_e``. That is our
per-expert LoRA exactly (a gated fc1 has one ``A_e`` and ``B_e = [B_gate; B_up]`` on ``[gate; up]``): the
export is exact, not a fit.

What HF PEFT does on a transformers-5 model decides the rest:

* it rewrites ``target_modules`` named like transformers 4's per-expert linears (Mixtral's w1/w2/w3, the
  ``gate_proj``/``up_proj``/``down_proj`` of the Qwen2-MoE-like families) into the fused expert
  parameters, so a dense MLP or shared expert of the same names would silently lose its adapter: those
  linears are targeted as parameters too (``<module>.weight``: a 2D ParamWrapper, the same ``W + s B A``
  and the same tensor keys as a module LoRA);
* ``ParamWrapper`` has neither dropout nor DoRA: an adapter with parameter targets is written with
  ``lora_dropout: 0`` (dropout acts only while training; weights and logits are unchanged), and a DoRA
  run with such targets is refused before anything is loaded (its merged export is exact);
* parameters of one module are wrapped in the module's parameter order, each wrapper around the previous
  one: the last is outermost (``experts.lora_A``), the first innermost (``experts.base_layer.lora_A``).

The names come from transformers itself: the HF model is built on the meta device (no memory) and its
conversion mapping renames the per-expert checkpoint names; each fused tensor's shape is checked against
the parameter it adapts. transformers 4 stores experts as separate linears and is not covered (refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

import torch

from megatron_recipes import families
from megatron_recipes.config import peft_methods as methods
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.families.hf_config import transformers_major
from megatron_recipes.families.transforms import Ctx

ROUTED = ("expert_fc1", "expert_fc2")
_ROUTED_KEYS = {"expert_fc1": "decoder.layers.mlp.experts.experts.linear_fc1.weight",
                "expert_fc2": "decoder.layers.mlp.experts.experts.linear_fc2.weight"}
_MLP_KEY = re.compile(r"^decoder\.layers\.mlp\.(?:shared_experts\.)?(linear_fc[12])\.weight$")
MERGED_FIX = "export the merged model instead (drop adapter_only=true): it folds every adapter in exactly"

Parts = Dict[str, torch.Tensor]  # "lora_A.weight" / "lora_B.weight" / "lora_magnitude_vector" -> tensor


@dataclass
class ExpertLoRA:
    """One routed-expert linear of one expert: ``B``'s rows by HF per-expert checkpoint name, and ``A``."""

    b_rows: Dict[str, torch.Tensor]
    a: torch.Tensor


@dataclass
class Placement:
    """The adapter file's tensors and the config's two target lists."""

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)  # adapter keys, without base_model.model.
    modules: List[str] = field(default_factory=list)  # target_modules (HF module leaf names)
    parameters: List[str] = field(default_factory=list)  # target_parameters (full HF parameter names)

    def described(self) -> List[str]:
        """The targets for people: module leaves, then parameters with ``layers.*`` for the layer index."""
        return self.modules + sorted({re.sub(r"\.layers\.\d+\.", ".layers.*.", name) for name in self.parameters})


def _hf_leaves(cfg: RunConfig, key: str, flags: Dict) -> Set[str]:
    """Leaf module names of the HF tensors a megatron tensor maps to (names only: a stand-in shape)."""
    transform = families.by_name(cfg.model.family).transform(key)
    names = transform.hf_shapes((2, 1), Ctx(cfg.model, 0, 0, flags))
    return {name.rsplit(".", 2)[-2] for name in names}


def _fused_experts(cfg: RunConfig) -> bool:
    """HF PEFT sees fused 3D expert parameters: a MoE model under transformers 5."""
    return bool(cfg.model.num_moe_experts) and transformers_major() >= 5


def _renamed_leaves(cfg: RunConfig, flags: Dict) -> Set[str]:
    """Leaf names HF PEFT rewrites into the fused expert parameters (transformers 4's per-expert linears)."""
    if not _fused_experts(cfg):
        return set()
    return set().union(*(_hf_leaves(cfg, key, flags) for key in _ROUTED_KEYS.values()))


def parameter_targets(cfg: RunConfig, flags: Dict) -> List[str]:
    """The ``peft.target_modules`` entries the adapter targets as HF parameters (``target_parameters``)."""
    if not _fused_experts(cfg):
        return []
    renamed = _renamed_leaves(cfg, flags)
    weights = families.by_name(cfg.model.family).weights
    out = []
    for kind in cfg.peft.target_modules:
        if kind in ROUTED:
            out.append(kind)
            continue
        keys = [k for k in weights if (m := _MLP_KEY.match(k)) and m.group(1) == kind]
        if any(_hf_leaves(cfg, k, flags) & renamed for k in keys):
            out.append(kind)
    return out


def check_expressible(cfg: RunConfig, flags: Dict) -> List[str]:
    """Refuse, before anything is loaded, what HF PEFT cannot hold exactly; return notes for the user."""
    targets = [k for k in cfg.peft.target_modules if k in ROUTED]
    if targets and transformers_major() < 5:
        raise RecipeError(
            f"adapters on routed experts ({', '.join(targets)}) are exported in transformers 5's form (LoRA on the "
            "fused expert parameters); this transformers is older and stores experts as separate linears",
            fix=f"install transformers>=5 for the export, or {MERGED_FIX}",
        )
    params = parameter_targets(cfg, flags)
    if not params:
        return []
    if methods.parse(cfg.peft.method).dora:
        raise RecipeError(
            f"DoRA on {', '.join(params)} of this {cfg.model.family} model has no HF PEFT form: on transformers 5 these "
            "are adapted as parameters (lora.ParamWrapper: routed experts are fused 3D tensors, and HF PEFT rewrites "
            "MLP linears named like transformers 4's experts), and HF PEFT's parameter LoRA has no DoRA",
            fix=f"{MERGED_FIX}, or train DoRA on attention linears only",
        )
    notes = [
        f"{', '.join(params)} written as HF PEFT target_parameters (transformers 5 fuses routed experts into parameters, "
        "and HF PEFT would move MLP linears of their names onto them); the LoRA is the run's, exactly"
    ]
    if cfg.peft.dropout:
        notes.append(
            f"lora_dropout is written as 0 (the run used {cfg.peft.dropout}): HF PEFT's parameter LoRA has no dropout; "
            "dropout acts only while training, so the adapter's weights and logits are the run's"
        )
    return notes


class _HFNames:
    """The HF model's own names and shapes (built on the meta device) and its checkpoint conversion mapping."""

    def __init__(self, hf_config):
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(hf_config)
        conversions = get_model_conversion_mapping(self.model)
        self.renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        self.converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self.params = dict(self.model.named_parameters())

    def rename(self, checkpoint_name: str):
        """``(model parameter name, converter or None, index of the matched source pattern)``."""
        from transformers.core_model_loading import rename_source_key

        name, pattern = rename_source_key(checkpoint_name, self.renamings, self.converters)
        if pattern is None:
            return name, None, 0
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        return name, converter, list(converter.source_patterns).index(pattern)

    def linear(self, module: str) -> str:
        """The model's module name of an HF checkpoint linear (``<module>.weight``), which must exist as is."""
        name, converter, _ = self.rename(f"{module}.weight")
        if converter is not None or name not in self.params or self.params[name].dim() != 2:
            raise RecipeError(f"HF linear {module} is not a plain linear weight in the transformers model", fix=MERGED_FIX)
        return name[: -len(".weight")]

    def parameter_order(self, module: str) -> List[str]:
        return list(self.model.get_submodule(module)._parameters)


def _check_fused_ops(converter, count: int, what: str) -> None:
    """Only the layout this module understands: experts stacked on dim 0, projections joined along rows."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    merge_ok = ops and isinstance(ops[0], MergeModulelist) and getattr(ops[0], "dim", None) == 0
    joined = len(ops) == 2 and isinstance(ops[1], Concatenate) and getattr(ops[1], "dim", None) == 1
    cat_ok = (len(ops) == 1 and count == 1) or joined
    if not (merge_ok and cat_ok) or count != len(converter.source_patterns):
        raise RecipeError(
            f"transformers stores {what} in a layout this export does not know ({[type(o).__name__ for o in ops]})",
            fix=MERGED_FIX,
        )


def _fuse(hf: _HFNames, group: Dict[int, ExpertLoRA], what: str) -> Tuple[str, Parts]:
    """One layer's routed-expert linear over all experts -> (HF parameter name, ParamWrapper tensors)."""
    experts = sorted(group)
    a_rows, b_cols, target = [], [], None
    for e in experts:
        placed = []
        for ckpt_name, rows in group[e].b_rows.items():
            name, converter, index = hf.rename(ckpt_name)
            if converter is None or target not in (None, name):
                raise RecipeError(f"{ckpt_name} does not map to one fused expert parameter in transformers", fix=MERGED_FIX)
            target = name
            _check_fused_ops(converter, len(group[e].b_rows), what)
            placed.append((index, rows))
        a_rows.append(group[e].a)
        b_cols.append(torch.cat([rows for _, rows in sorted(placed, key=lambda p: p[0])], dim=0))
    param = hf.params.get(target)
    module = hf.model.get_submodule(target.rpartition(".")[0])
    want = (len(experts), b_cols[0].shape[0], a_rows[0].shape[1])
    transposed = getattr(module, "is_transposed", False)  # [E, in, out]: not the layout ParamWrapper's swap assumes
    if param is None or tuple(param.shape) != want or experts != list(range(want[0])) or transposed:
        got = None if param is None else tuple(param.shape)
        raise RecipeError(f"{what}: transformers' {target} is {got}, the adapter is for [experts, out, in] = {want}", fix=MERGED_FIX)
    a = torch.cat(a_rows, dim=0)  # [E*r, in], expert-major
    b = torch.stack(b_cols, dim=-1).reshape(want[1], -1)  # [out, r*E], column i*E + e
    return target, {"lora_A.weight": a, "lora_B.weight": b}


def place(
    cfg: RunConfig, hf_config, flags: Dict, linears: Dict[str, Parts], routed: Dict[str, Dict[int, ExpertLoRA]]
) -> Placement:
    """``linears``: HF checkpoint module name -> its adapter; ``routed``: a label per layer's expert linear ->
    expert -> its adapter. Returns the adapter file's keys and the config's targets."""
    out = Placement()
    if routed and not _fused_experts(cfg):
        raise RecipeError("routed-expert adapters need transformers>=5 for their HF PEFT form", fix=MERGED_FIX)
    if not _fused_experts(cfg):  # dense families (and MoE under transformers 4 without expert adapters): modules
        for module, parts in linears.items():
            out.tensors.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
        out.modules = sorted({m.rsplit(".", 1)[-1] for m in linears})
        return out
    hf = _HFNames(hf_config)
    renamed = _renamed_leaves(cfg, flags)
    params: Dict[str, Parts] = {}
    for checkpoint_module, parts in linears.items():
        module = hf.linear(checkpoint_module)
        if checkpoint_module.rsplit(".", 1)[-1] in renamed:
            params[f"{module}.weight"] = parts
        else:
            out.tensors.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
            out.modules.append(module.rsplit(".", 1)[-1])
    for what, group in routed.items():
        name, parts = _fuse(hf, group, what)
        params[name] = parts
    by_module: Dict[str, List[str]] = {}
    for name in params:
        by_module.setdefault(name.rpartition(".")[0], []).append(name.rpartition(".")[2])
    for module, names in by_module.items():
        wrapped = [p for p in hf.parameter_order(module) if p in names]  # PEFT's wrapping order: first is innermost
        for depth, param in enumerate(wrapped):
            prefix = module + ".base_layer" * (len(wrapped) - 1 - depth)
            out.tensors.update({f"{prefix}.{suffix}": t for suffix, t in params[f"{module}.{param}"].items()})
    out.modules = sorted(set(out.modules))
    out.parameters = sorted(params)
    return out
