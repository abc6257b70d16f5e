"""``apply_peft``: freeze the base and attach the recipe's adapters, before megatron-core's DDP wrap.

The trainer calls it once, after building the model chunks and loading ``checkpoint.pretrained``.
megatron-core's DDP and ``get_megatron_optimizer`` skip parameters with ``requires_grad=False``, so
after this only adapter parameters get gradient buffers and optimizer state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, List, Tuple

import torch

from megatron_recipes.config.errors import RecipeError, ValidationError
from megatron_recipes.config import peft_methods as methods
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.peft.linears import attention_modules, find_targets, layout_of, present_kinds
from megatron_recipes.peft.lora import LoRALinear
from megatron_recipes.peft.ptuning import PrefixCoreAttention, PrefixKV
from megatron_recipes.peft.qlora import NF4ParallelLinear, check_quantizable, quantize_module
from megatron_recipes.runtime import collectives

log = logging.getLogger(__name__)


@dataclass
class PeftSummary:
    method: str
    trainable: int  # whole model, every rank's unique parameters
    total: int
    adapted: List[str] = field(default_factory=list)  # canonical names of adapted modules on this rank
    base_bytes_bf16: int = 0  # targeted base weights as bf16 (whole model), QLoRA only
    base_bytes_stored: int = 0  # the same weights as stored now (NF4 + scales), QLoRA only

    @property
    def trainable_percent(self) -> float:
        return 100.0 * self.trainable / self.total if self.total else 0.0

    @property
    def memory_reduction(self) -> float:
        return self.base_bytes_bf16 / self.base_bytes_stored if self.base_bytes_stored else 1.0

    def lines(self) -> List[str]:
        """The start-of-run report, worded as HF PEFT's ``print_trainable_parameters``."""
        out = [f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable%: {self.trainable_percent:.4f}"]
        if self.base_bytes_stored:
            mib = 1024**2
            out.append(
                f"base linear weights: {self.base_bytes_bf16 / mib:,.2f} MiB as bf16 -> {self.base_bytes_stored / mib:,.2f} MiB "
                f"as NF4 with double-quantised scales ({self.memory_reduction:.2f}x smaller)"
            )
        return out


def _check_not_applied(chunks: List[torch.nn.Module]) -> None:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (LoRALinear, PrefixCoreAttention)):
                raise RecipeError("apply_peft was called twice on the same model", fix="call it once, after loading the base")


def _check_static(cfg: RunConfig) -> None:
    from megatron_recipes.validation.rules_peft import PEFT_RULES
    from megatron_recipes.validation.validate import validate

    violations = validate(cfg, rules=PEFT_RULES)
    if violations:
        raise ValidationError(violations, recipe=cfg.run.name)


def _check_targets(chunks: List[torch.nn.Module], cfg: RunConfig, found) -> None:
    """Names the model does not have, and ranks larger than a targeted layer, fail before any change."""
    present = present_kinds(chunks)
    missing = [name for name, targets in found.items() if not targets]
    grouped = [name for name in missing if name.startswith("expert_") and getattr(chunks[0].config, "moe_grouped_gemm", False)]
    if grouped:  # Transformer Engine's grouped-GEMM experts hold every local expert in one GroupedLinear
        raise RecipeError(
            f"peft.target_modules names {grouped}, but this run builds its routed experts as grouped GEMMs "
            "(moe_grouped_gemm with Transformer Engine), which take no LoRA adapter here (adapters go on "
            "megatron-core's per-expert linears, built without Transformer Engine)",
            fix="leave expert_fc1/expert_fc2 out of peft.target_modules on Transformer Engine runs "
            "(attention and shared-expert linears still take adapters)",
        )
    if missing:  # a name may legitimately be absent on this pipeline stage only if the model has it
        local_layers = any(True for chunk in chunks for _ in attention_modules(chunk))
        if local_layers:
            raise RecipeError(
                f"peft.target_modules names {missing}, which this model does not have",
                fix=f"use some of {present} (expert_fc1/expert_fc2 exist only in MoE models)",
            )
    for name, targets in found.items():
        for target in targets[:1]:
            lay = layout_of(target.module)
            limit = min(lay.in_full, lay.out_full)
            if cfg.peft.rank > limit:
                raise RecipeError(
                    f"peft.rank={cfg.peft.rank} is larger than {name} ({target.canonical}: "
                    f"{lay.in_full} -> {lay.out_full} features)",
                    fix=f"use peft.rank <= {limit}, or drop {name} from peft.target_modules",
                )


def _wrap_linears(chunks: List[torch.nn.Module], cfg: RunConfig, method: methods.Method) -> List[str]:
    p = cfg.peft
    found = find_targets(chunks, list(p.target_modules))
    _check_targets(chunks, cfg, found)
    if method.quantize:
        for targets in found.values():
            for t in targets:
                check_quantizable(t, p)
    adapted = []
    gated = bool(chunks[0].config.gated_linear_unit)
    for targets in found.values():
        for t in targets:
            base = t.module
            if method.quantize:
                base = quantize_module(base, p)
            wrapped = LoRALinear(
                base,
                name=t.canonical,
                rank=p.rank,
                alpha=p.alpha,
                dropout=p.dropout,
                dora=method.dora,
                seed=cfg.seed,
                gated_fc1=gated and t.kind in ("linear_fc1", "expert_fc1"),
            )
            setattr(t.parent, t.attr, wrapped)
            adapted.append(t.canonical)
    return adapted


def _add_prefixes(chunks: List[torch.nn.Module], cfg: RunConfig) -> List[str]:
    from megatron.core import parallel_state

    p = cfg.peft
    adapted = []
    for chunk in chunks:
        for name, attention in list(attention_modules(chunk)):
            device = attention.linear_qkv.weight.device if getattr(attention.linear_qkv, "weight", None) is not None else torch.device("cpu")
            prefix = PrefixKV(
                chunk.config,
                name,
                p.prefix_length,
                p.prefix_projection,
                p.prefix_projection_hidden,
                cfg.seed,
                parallel_state.get_tensor_model_parallel_group(),
                device,
            )
            attention.core_attention = PrefixCoreAttention(attention.core_attention, prefix)
            adapted.append(f"{name}.core_attention")
    return adapted


def _unfreeze_saved(chunks: List[torch.nn.Module], names: List[str]) -> List[str]:
    """``peft.modules_to_save``: these base modules train whole; adapter checkpoints keep every trainable
    tensor, so they are saved and resumed with the adapters. Only the last pipeline stage has the head."""
    trained = []
    for chunk in chunks:
        for name in names:
            module = getattr(chunk, name, None)
            if module is None:
                continue
            if getattr(module, "weight", None) is None:
                raise RecipeError(
                    f"peft.modules_to_save names {name}, which has no weight of its own here (tied to the embedding)",
                    fix="set model.tie_embeddings=false, or leave it out of peft.modules_to_save",
                )
            for param in module.parameters():
                param.requires_grad_(True)
            trained.append(name)
    return trained


def apply_peft(model_chunks: List[torch.nn.Module], cfg: RunConfig, report: bool = True) -> PeftSummary:
    """Freeze the base, attach adapters per ``cfg.peft``, print the parameter counts (rank 0)."""
    method = methods.parse(cfg.peft.method)
    if method.none:
        totals = count_parameters(model_chunks)
        summary = PeftSummary("none", totals.trainable, totals.total)
    else:
        _check_static(cfg)
        _check_not_applied(model_chunks)
        for chunk in model_chunks:
            for param in chunk.parameters():
                param.requires_grad_(False)
        before = ParamTotals.targeted_bf16_bytes(model_chunks, cfg) if method.quantize else 0
        adapted = _add_prefixes(model_chunks, cfg) if method.prefix else _wrap_linears(model_chunks, cfg, method)
        adapted += _unfreeze_saved(model_chunks, list(cfg.peft.modules_to_save))
        totals = count_parameters(model_chunks)
        summary = PeftSummary(
            cfg.peft.method,
            totals.trainable,
            totals.total,
            adapted,
            base_bytes_bf16=before,
            base_bytes_stored=totals.quantized_bytes if method.quantize else 0,
        )
    if report and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        for line in summary.lines():
            print(line, flush=True)
            log.info(line)
    return summary


# --- whole-model parameter counts (what PEFT users see at start) ----------------------------------
# A parameter is counted on the ranks that own a unique piece of it: tensor-parallel shards everywhere,
# replicated tensors on TP rank 0 only; then dense counts are summed over the TP x PP group and expert
# counts over the expert TP x EP x PP group. NF4 base weights are not parameters; they count with their
# logical size (as HF PEFT counts 4-bit weights) and their stored bytes are reported apart.


@dataclass
class ParamTotals:
    trainable: int
    total: int
    quantized_bytes: int  # NF4 storage of quantised base weights (whole model)
    quantized_numel: int

    @staticmethod
    def targeted_bf16_bytes(chunks: List[torch.nn.Module], cfg) -> int:
        """Bytes the base weights that QLoRA will quantise take as bf16 (whole model)."""
        local_dense = local_expert = 0
        for name, targets in find_targets(chunks, list(cfg.peft.target_modules)).items():
            for t in targets:
                n = t.module.weight.numel() * 2
                if name.startswith("expert_"):
                    local_expert += n
                else:
                    local_dense += n
        dense, expert = _reduce([local_dense, 0, 0, 0], [local_expert, 0, 0, 0])
        return dense[0] + expert[0]


def _is_expert(name: str) -> bool:
    """Routed-expert tensors (split over expert TP x EP) live under ``mlp.experts.``."""
    return ".experts." in f".{name}"


def _unique_here(param: torch.nn.Parameter, expert: bool, tp_rank: int, etp_rank: int) -> bool:
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (etp_rank if expert else tp_rank) == 0


def _reduce(dense: List[int], expert: List[int]) -> Tuple[List[int], List[int]]:
    """Whole-model counts: Python ints summed over the model-parallel groups (NCCL groups on GPUs, which
    take no host tensors: the collectives' owner puts them on the device)."""
    from megatron.core import parallel_state

    dense, expert = [int(v) for v in dense], [int(v) for v in expert]
    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
        dense = collectives.all_reduce_values(dense, group=parallel_state.get_model_parallel_group())
        expert = collectives.all_reduce_values(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    return dense, expert


def _ranks() -> Tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()


def _local_counts(chunks: Iterable[torch.nn.Module]) -> Tuple[List[int], List[int]]:
    tp_rank, etp_rank = _ranks()
    dense = [0, 0, 0, 0]  # trainable, total, quantized bytes, quantized numel
    expert = [0, 0, 0, 0]
    for chunk in chunks:
        first_stage = getattr(chunk, "pre_process", True)
        for name, param in chunk.named_parameters():
            if getattr(param, "shared", False) and not first_stage:
                continue  # tied output weight on the last stage: the embedding already counted it
            is_expert = _is_expert(name)
            if not _unique_here(param, is_expert, tp_rank, etp_rank):
                continue
            bucket = expert if is_expert else dense
            bucket[1] += param.numel()
            if param.requires_grad:
                bucket[0] += param.numel()
        for module in chunk.modules():
            if isinstance(module, NF4ParallelLinear):
                bucket = expert if module.layout.is_expert else dense
                bucket[1] += module.weight_numel
                bucket[2] += module.quantized_nbytes()
                bucket[3] += module.weight_numel
    return dense, expert


def count_parameters(chunks: List[torch.nn.Module]) -> ParamTotals:
    dense, expert = _reduce(*_local_counts(chunks))
    both = [a + b for a, b in zip(dense, expert)]
    return ParamTotals(trainable=both[0], total=both[1], quantized_bytes=both[2], quantized_numel=both[3])
