"""Rules on the architecture itself: attention shape, positions, vocabulary padding, MLA."""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config.schema import ACTIVATIONS, NORMALIZATIONS, POSITION_TYPES, ROPE_SCALING_TYPES, RunConfig
from megatron_recipes.families import FAMILIES  # the mapping modules (a family without one would only fail at export)
from megatron_recipes.validation.rules_base import choices, divisors, one_of, rule

SIZES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "max_position_embeddings")
OPTIONAL_SIZES = ("kv_channels", "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                  "sliding_window", "mtp_num_layers")


@rule(
    "model.sizes_positive",
    ["model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.ffn_hidden_size",
     "model.vocab_size", "model.max_position_embeddings", "model.kv_channels", "model.num_moe_experts"],
    "layer count, widths, head count, vocabulary and context are >= 1 (optional sizes: null or >= 1)",
    "set the named sizes to positive integers",
)
def _sizes_positive(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    bad = [f"model.{n}={getattr(m, n)}" for n in SIZES if getattr(m, n) < 1]
    bad += [f"model.{n}={getattr(m, n)}" for n in OPTIONAL_SIZES if getattr(m, n) is not None and getattr(m, n) < 1]
    if m.moe_first_dense_layers < 0:
        bad.append(f"model.moe_first_dense_layers={m.moe_first_dense_layers}")
    return f"{', '.join(bad)} must be >= 1 (counts >= 0)" if bad else None


@rule(
    "model.family",
    ["model.family"],
    "model.family names a family with a conversion mapping (a module megatron_recipes/families/<family>.py)",
    f"use one of {', '.join(FAMILIES)}",
)
def _family(cfg: RunConfig) -> Optional[str]:
    return one_of(cfg.model.family, FAMILIES, "model.family")


@rule(
    "model.query_groups_divide_heads",
    ["model.num_attention_heads", "model.num_query_groups"],
    "num_attention_heads is a multiple of num_query_groups (GQA shares each K/V head among whole groups)",
    "set model.num_query_groups to a divisor of num_attention_heads",
    model_layout=True,
)
def _groups_divide_heads(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if m.multi_latent_attention:
        return None
    if m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups == 0:
        return None
    return (
        f"model.num_attention_heads={m.num_attention_heads} is not a multiple of model.num_query_groups="
        f"{m.num_query_groups}; use num_query_groups in {choices(divisors(m.num_attention_heads))}"
    )


@rule(
    "model.head_dim",
    ["model.hidden_size", "model.num_attention_heads", "model.kv_channels"],
    "without kv_channels, hidden_size is divisible by num_attention_heads (the head dimension)",
    "set model.kv_channels explicitly, or a head count dividing hidden_size",
    model_layout=True,
)
def _head_dim(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if m.kv_channels or m.multi_latent_attention or (m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads == 0):
        return None
    return f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads} and kv_channels is unset"


@rule(
    "model.sequence_within_context",
    ["train.seq_length", "model.max_position_embeddings"],
    "train.seq_length does not exceed the model's max_position_embeddings",
    "lower train.seq_length, or raise model.max_position_embeddings deliberately (with RoPE scaling for long context)",
)
def _seq_within_context(cfg: RunConfig) -> Optional[str]:
    s, m = cfg.train.seq_length, cfg.model
    if s <= m.max_position_embeddings:
        return None
    return f"train.seq_length={s} exceeds model.max_position_embeddings={m.max_position_embeddings}"


@rule(
    "model.option_values",
    ["model.normalization", "model.activation", "model.position_embedding_type"],
    "normalization, activation and position embedding name implementations the model builder has",
    "use a listed value",
    model_layout=True,
)
def _model_options(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    return (
        one_of(m.normalization, NORMALIZATIONS, "model.normalization")
        or one_of(m.activation, ACTIVATIONS, "model.activation")
        or one_of(m.position_embedding_type, POSITION_TYPES, "model.position_embedding_type")
    )


@rule(
    "model.rope_settings",
    ["model.rope_scaling", "model.position_embedding_type", "model.rotary_percent", "model.rotary_base"],
    "RoPE scaling needs RoPE; rope_type is llama3 or yarn with factor >= 1; 0 < rotary_percent <= 1",
    "fix the RoPE fields named above",
    model_layout=True,
)
def _rope(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not 0.0 < m.rotary_percent <= 1.0:
        return f"model.rotary_percent={m.rotary_percent} must be in (0, 1]"
    if m.rotary_base <= 0:
        return f"model.rotary_base={m.rotary_base} must be > 0"
    rs = m.rope_scaling
    if rs is None:
        return None
    if m.position_embedding_type != "rope":
        return f"model.rope_scaling is set but model.position_embedding_type={m.position_embedding_type!r}; RoPE scaling needs rope"
    if rs.rope_type not in ROPE_SCALING_TYPES:
        return f"model.rope_scaling.rope_type={rs.rope_type!r} is not one of {choices(ROPE_SCALING_TYPES)}"
    if rs.factor < 1.0:
        return f"model.rope_scaling.factor={rs.factor} must be >= 1"
    return None


# megatron-core 0.16 scales RoPE with YaRN under multi-latent attention (MLATransformerConfig's fields) and
# with llama3 otherwise, where RotaryEmbedding passes only the factor: these three stay at its fixed values.
MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@rule(
    "model.rope_scaling_mcore",
    ["model.rope_scaling", "model.multi_latent_attention"],
    "RoPE scaling is one megatron-core honours: yarn with multi-latent attention; llama3 otherwise, with "
    "low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192 (megatron-core fixes them)",
    "use rope_type=yarn with MLA (as DeepSeek-V3), llama3 with those fixed values otherwise (only the factor "
    "varies), or drop model.rope_scaling",
    model_layout=True,
)
def _rope_scaling_mcore(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    rs = m.rope_scaling
    if rs is None or rs.rope_type not in ROPE_SCALING_TYPES or m.position_embedding_type != "rope":
        return None  # model.rope_settings speaks
    wanted = "yarn" if m.multi_latent_attention else "llama3"
    if rs.rope_type != wanted:
        attention = "with" if m.multi_latent_attention else "without"
        return f"model.rope_scaling.rope_type={rs.rope_type!r} {attention} multi-latent attention: megatron-core scales it with {wanted} only"
    if wanted == "llama3":
        bad = [f"model.rope_scaling.{k}={getattr(rs, k)}" for k, v in MCORE_LLAMA3_FIXED.items() if getattr(rs, k) != v]
        if bad:
            fixed = ", ".join(f"{k}={v}" for k, v in MCORE_LLAMA3_FIXED.items())
            return f"{', '.join(bad)}: megatron-core's llama3 scaling takes only the factor and fixes {fixed}"
    return None


@rule(
    "vocab.padding",
    ["model.make_vocab_size_divisible_by", "model.vocab_size"],
    "vocab padding multiple is 1 (no padding) or a multiple of 8 (tensor-core GEMM shapes); vocab_size >= 1",
    "use model.make_vocab_size_divisible_by=128 (megatron's default) or 1",
    model_layout=True,
)
def _vocab_padding(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if m.vocab_size < 1:
        return f"model.vocab_size={m.vocab_size} must be >= 1"
    d = m.make_vocab_size_divisible_by
    if d == 1 or (d >= 8 and d % 8 == 0):
        return None
    return f"model.make_vocab_size_divisible_by={d} is neither 1 nor a multiple of 8; use one of {{1, 64, 128, 256}}"


@rule(
    "vocab.builtin_tokenizer_fits",
    ["data.builtin_vocab_size", "model.vocab_size", "data.kind"],
    "the built-in tokenizer's vocabulary fits in the model's embedding",
    "set data.builtin_vocab_size <= model.vocab_size",
)
def _builtin_vocab(cfg: RunConfig) -> Optional[str]:
    d, m = cfg.data, cfg.model
    if d.kind != "builtin" or d.builtin_vocab_size <= m.vocab_size:
        return None
    return f"data.builtin_vocab_size={d.builtin_vocab_size} > model.vocab_size={m.vocab_size}: token ids would index past the embedding"


@rule(
    "mla.fields",
    ["model.multi_latent_attention", "model.kv_lora_rank", "model.qk_head_dim", "model.qk_pos_emb_head_dim", "model.v_head_dim"],
    "multi-latent attention needs kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim and v_head_dim (all > 0)",
    "set the MLA dimensions as published (DeepSeek-V3: 512, 128, 64, 128)",
    model_layout=True,
)
def _mla_fields(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not m.multi_latent_attention:
        return None
    names = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    bad = [f"model.{n}={getattr(m, n)}" for n in names if not getattr(m, n) or getattr(m, n) < 1]
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        bad.append(f"model.q_lora_rank={m.q_lora_rank}")
    return f"multi_latent_attention=true but {', '.join(bad)} (must be >= 1)" if bad else None


@rule(
    "mla.rope",
    ["model.multi_latent_attention", "model.position_embedding_type"],
    "MLA applies RoPE to its decoupled qk_pos_emb part, so position_embedding_type is rope",
    "set model.position_embedding_type=rope",
    model_layout=True,
)
def _mla_rope(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if m.multi_latent_attention and m.position_embedding_type != "rope":
        return f"multi_latent_attention=true with position_embedding_type={m.position_embedding_type!r}"
    return None


@rule(
    "mla.no_qkv_bias",
    ["model.multi_latent_attention", "model.add_qkv_bias"],
    "MLA has no fused QKV projection: add_qkv_bias would be silently ignored",
    "set model.add_qkv_bias=false (MLA's projections are bias-free)",
)
def _mla_no_qkv_bias(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if m.multi_latent_attention and m.add_qkv_bias:
        return "multi_latent_attention=true with model.add_qkv_bias=true"
    return None


@rule(
    "mla.latent_norms",
    ["model.multi_latent_attention", "model.qk_layernorm"],
    "MLA normalises its compressed q/kv latents; megatron-core builds those norms only with qk_layernorm=true",
    "set model.qk_layernorm=true (DeepSeek-V2/V3's q_a_layernorm and kv_a_layernorm)",
)
def _mla_latent_norms(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if m.multi_latent_attention and not m.qk_layernorm:
        return "multi_latent_attention=true with model.qk_layernorm=false: the q/kv latent norms would be missing"
    return None


@rule(
    "model.mtp_loss_scaling_factor",
    ["model.mtp_loss_scaling_factor", "model.mtp_num_layers"],
    "with MTP layers, their loss weight is > 0: megatron-core adds the MTP loss times it to the gradients, so a "
    "negative weight trains the MTP layers away from the next tokens and 0 leaves them to weight decay alone",
    "set model.mtp_loss_scaling_factor > 0 (megatron-core's default 0.1; DeepSeek-V3 used 0.3, then 0.1), or "
    "model.mtp_num_layers=null for no MTP layers",
)
def _mtp_loss_scaling_factor(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not m.mtp_num_layers or m.mtp_loss_scaling_factor > 0:
        return None
    return f"model.mtp_loss_scaling_factor={m.mtp_loss_scaling_factor} with model.mtp_num_layers={m.mtp_num_layers} must be > 0"


MODEL_RULES = [
    _sizes_positive,
    _family,
    _groups_divide_heads,
    _head_dim,
    _seq_within_context,
    _model_options,
    _rope,
    _rope_scaling_mcore,
    _vocab_padding,
    _builtin_vocab,
    _mla_fields,
    _mla_rope,
    _mla_no_qkv_bias,
    _mla_latent_norms,
    _mtp_loss_scaling_factor,
]
