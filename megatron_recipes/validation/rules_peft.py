"""Rules on parameter-efficient fine-tuning (``peft.*``), checked before any process starts.

Layer sizes come from the model config the way megatron-core builds them (fused QKV, gated FC1), so a
rank larger than a layer or an NF4 block that does not tile a rank's rows is reported with the layer's
real numbers. ``apply_peft`` checks the built modules again (it sees the model actually loaded).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_recipes.config import derived, peft_methods as methods
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import rule

TARGETS = methods.TARGETS


def _method(cfg: RunConfig):
    if methods.why_not(cfg.peft.method):
        return None
    return methods.parse(cfg.peft.method)


def _uses_lora(cfg: RunConfig) -> bool:
    m = _method(cfg)
    return bool(m and m.lora)


def linear_dims(cfg: RunConfig) -> Dict[str, List[Tuple[int, int, str, int]]]:
    """name -> [(in_features, out_features, column|row, tp split), ...] for the linears this model has
    (fc1/fc2 can come in two sizes: dense layers and shared experts)."""
    m, p = cfg.model, cfg.parallel
    hd = derived.head_dim(m)
    gate = 2 if m.activation == "swiglu" else 1
    tp, etp = max(1, p.tp), max(1, derived.expert_tensor_parallel_size(cfg))
    dims: Dict[str, List[Tuple[int, int, str, int]]] = {}
    if not m.multi_latent_attention:
        dims["linear_qkv"] = [(m.hidden_size, (m.num_attention_heads + 2 * m.num_query_groups) * hd, "column", tp)]
        dims["linear_proj"] = [(m.num_attention_heads * hd, m.hidden_size, "row", tp)]
    ffns = []
    if not derived.is_moe(m) or m.moe_first_dense_layers:
        ffns.append(m.ffn_hidden_size)
    if derived.is_moe(m) and m.moe_shared_expert_intermediate_size:
        ffns.append(m.moe_shared_expert_intermediate_size)
    if ffns:
        dims["linear_fc1"] = [(m.hidden_size, gate * f, "column", tp) for f in ffns]
        dims["linear_fc2"] = [(f, m.hidden_size, "row", tp) for f in ffns]
    if derived.is_moe(m):
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        dims["expert_fc1"] = [(m.hidden_size, gate * moe_ffn, "column", etp)]
        dims["expert_fc2"] = [(moe_ffn, m.hidden_size, "row", etp)]
    return dims


@rule("peft.method", ["peft.method"], "peft.method is none, lora, dora, qlora, ptuning or qlora+dora", "use one of the listed methods")
def _valid_method(cfg: RunConfig) -> Optional[str]:
    return methods.why_not(cfg.peft.method)


@rule(
    "peft.lora_values",
    ["peft.rank", "peft.alpha", "peft.dropout", "peft.target_modules"],
    "LoRA rank >= 1, alpha > 0, 0 <= dropout < 1, and target_modules name linears the model has",
    lambda cfg: f"target some of {sorted(linear_dims(cfg))} with a positive rank and alpha",
)
def _lora_values(cfg: RunConfig) -> Optional[str]:
    if not _uses_lora(cfg):
        return None
    p = cfg.peft
    if p.rank < 1 or p.alpha <= 0 or not 0.0 <= p.dropout < 1.0:
        return f"peft.rank={p.rank}, peft.alpha={p.alpha}, peft.dropout={p.dropout}: need rank >= 1, alpha > 0, 0 <= dropout < 1"
    if not p.target_modules:
        return "peft.target_modules is empty: the adapter would train nothing"
    unknown = [t for t in p.target_modules if t not in TARGETS]
    if unknown:
        return f"peft.target_modules has unknown module name(s) {unknown}; valid names: {', '.join(TARGETS)}"
    absent = [t for t in p.target_modules if t not in linear_dims(cfg)]
    if absent:
        return f"peft.target_modules names {absent}, which model {cfg.model.name} does not have (it has {sorted(linear_dims(cfg))})"
    return None


@rule(
    "peft.rank_fits",
    ["peft.rank", "peft.target_modules", "model.*"],
    "the LoRA rank is at most the smaller dimension of every targeted linear",
    "lower peft.rank or leave the small layer out of peft.target_modules",
)
def _rank_fits(cfg: RunConfig) -> Optional[str]:
    if not _uses_lora(cfg):
        return None
    dims = linear_dims(cfg)
    for name in cfg.peft.target_modules:
        for d_in, d_out, _, _ in dims.get(name, []):
            if cfg.peft.rank > min(d_in, d_out):
                return f"peft.rank={cfg.peft.rank} is larger than {name} ({d_in} -> {d_out} features); use peft.rank <= {min(d_in, d_out)}"
    return None


@rule(
    "peft.nf4_blocks",
    ["peft.nf4_block_size", "peft.double_quant_block_size", "peft.nf4_backend", "parallel.tp"],
    "QLoRA's NF4 block size is even and divides the input features each rank holds of every targeted linear",
    "use peft.nf4_block_size=64 (or another divisor named in the message)",
)
def _nf4_blocks(cfg: RunConfig) -> Optional[str]:
    m = _method(cfg)
    if not (m and m.quantize):
        return None
    p = cfg.peft
    if p.nf4_backend not in ("auto", "torch", "bnb"):
        return f"peft.nf4_backend={p.nf4_backend!r} is not one of auto, torch, bnb"
    if p.nf4_block_size < 2 or p.nf4_block_size % 2:
        return f"peft.nf4_block_size={p.nf4_block_size} must be an even number >= 2"
    if p.double_quant and p.double_quant_block_size < 1:
        return f"peft.double_quant_block_size={p.double_quant_block_size} must be >= 1"
    dims = linear_dims(cfg)
    for name in p.target_modules:
        for d_in, _, kind, split in dims.get(name, []):
            per_rank = d_in // split if kind == "row" else d_in
            if per_rank % p.nf4_block_size:
                good = [b for b in (16, 32, 64, 128, 256) if per_rank % b == 0]
                return (
                    f"peft.nf4_block_size={p.nf4_block_size} does not divide the {per_rank} input features per rank of {name}"
                    f" ({d_in} split {split if kind == 'row' else 1} ways); block sizes that do: {good or 'none of 16..256'}"
                )
    return None


@rule(
    "peft.prefix_room",
    ["peft.prefix_length", "train.seq_length", "model.max_position_embeddings"],
    "P-Tuning v2: prefix_length >= 1 and seq_length + prefix_length <= max_position_embeddings",
    lambda cfg: (
        f"use train.seq_length <= {cfg.model.max_position_embeddings - max(1, cfg.peft.prefix_length)} "
        "or a shorter peft.prefix_length"
    ),
)
def _prefix_room(cfg: RunConfig) -> Optional[str]:
    m = _method(cfg)
    if not (m and m.prefix):
        return None
    p, t = cfg.peft, cfg.train
    if p.prefix_length < 1 or (p.prefix_projection and p.prefix_projection_hidden < 1):
        return f"peft.prefix_length={p.prefix_length}, peft.prefix_projection_hidden={p.prefix_projection_hidden} must be >= 1"
    if t.seq_length + p.prefix_length > cfg.model.max_position_embeddings:
        return (
            f"train.seq_length={t.seq_length} + peft.prefix_length={p.prefix_length} = {t.seq_length + p.prefix_length} "
            f"exceeds model.max_position_embeddings={cfg.model.max_position_embeddings}: no room for the prefix"
        )
    return None


@rule(
    "peft.prefix_layout",
    ["peft.method", "parallel.cp", "model.multi_latent_attention", "model.sliding_window", "data.packing"],
    "P-Tuning v2 runs without context parallelism, on full causal attention, and (on GPUs) on unpacked sequences",
    "set parallel.cp=1, and data.packing=false on GPU clusters; use LoRA for sliding-window or MLA models",
)
def _prefix_layout(cfg: RunConfig) -> Optional[str]:
    m = _method(cfg)
    if not (m and m.prefix):
        return None
    if cfg.parallel.cp > 1:
        return f"parallel.cp={cfg.parallel.cp}: prefixes would have to live on one context-parallel rank's keys only"
    if cfg.model.multi_latent_attention:
        return "multi-latent attention has no per-group keys/values to prefix"
    if getattr(cfg.model, "sliding_window", None):
        return f"model.sliding_window={cfg.model.sliding_window}: the widened prefix mask is causal over the whole sequence"
    if cfg.cluster.gpu_arch != "cpu" and cfg.data.kind == "sft" and cfg.data.packing:
        return "data.packing=true packs sequences as THD on GPUs, where each sequence would need its own prefix"
    return None


@rule(
    "peft.needs_pretrained",
    ["peft.method", "data.kind", "checkpoint.pretrained"],
    "fine-tuning (adapters, or full SFT on data.kind=sft) starts from checkpoint.pretrained",
    "set checkpoint.pretrained=<converted checkpoint> (see `megatron-recipes convert import`)",
    scope="input",
    needs="checkpoint.pretrained",
)
def _needs_pretrained(cfg: RunConfig) -> Optional[str]:
    m = _method(cfg)
    if not m or cfg.checkpoint.pretrained or cfg.train.train_iters == 0:
        return None  # train_iters=0 writes seed weights and trains nothing (the `check` seed run does this)
    if not m.none:
        return f"peft.method={cfg.peft.method} freezes the base, but checkpoint.pretrained is unset: it would train adapters on random weights"
    if cfg.data.kind == "sft":
        return "data.kind=sft fine-tunes a model, but checkpoint.pretrained is unset: it would start from random weights"
    return None


SAVABLE_MODULES = ("output_layer",)


@rule(
    "peft.modules_to_save",
    ["peft.modules_to_save", "peft.method", "model.tie_embeddings"],
    "peft.modules_to_save names base modules an adapter run can train whole (output_layer, untied from the embedding)",
    "use peft.modules_to_save=[output_layer] with model.tie_embeddings=false, or leave it empty",
)
def _modules_to_save(cfg: RunConfig) -> Optional[str]:
    names = list(cfg.peft.modules_to_save)
    m = _method(cfg)
    if not names or not m or m.none:  # with peft.method=none every module trains already
        return None
    unknown = [n for n in names if n not in SAVABLE_MODULES]
    if unknown:
        return f"peft.modules_to_save has unknown module name(s) {unknown}; valid names: {', '.join(SAVABLE_MODULES)}"
    if "output_layer" in names and cfg.model.tie_embeddings:
        return "peft.modules_to_save=[output_layer] with model.tie_embeddings=true: the head is the frozen embedding"
    return None


PEFT_RULES = [_valid_method, _lora_values, _rank_fits, _nf4_blocks, _prefix_room, _prefix_layout, _needs_pretrained,
              _modules_to_save]
