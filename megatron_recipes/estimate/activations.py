"""Bytes autograd keeps for backward, per microbatch, layer by layer (the activation memory).

Two kernel sets are modelled, because they save different tensors:

* ``local`` - megatron-core's local layer spec as the project builds it (``models/local_spec.py``), what
  the CPU lane runs: composite RMSNorm (saves its input and normalised output), SDPA core attention
  (saves Q, K and V expanded to all heads, its output and log-sum-exp; with a sliding window megatron-core's
  unfused path also keeps the ``b x heads x s x s`` softmax; under CP, K and V are all-gathered so they
  span the whole sequence, and SDPA keeps its ``s/cp x s`` mask), unfused SwiGLU (saves FC1's output, SiLU's
  output and the linear half); MLA runs megatron-core's unfused attention (its q/k and v head sizes differ),
  keeping the ``b x heads x s x s`` softmax.
  Tests hold this model to within 10% of what ``saved_tensors_hooks`` sees on built models.
* ``te`` - the Transformer Engine spec on GPUs: fused LayerNorm+Linear (input and normalised output),
  flash attention (Q, K, V and output; no ``s x s`` term), fused SwiGLU (FC1 output only). This is the
  same accounting with TE's kernels; it is not measurable on CPU.

Per token on one rank, with ``a``/``g`` heads/query groups per TP rank, ``d`` head dim, ``hs`` the
hidden size divided by TP under sequence parallelism, and ``f`` the FFN width per TP rank:

    local attention  = 3 hs + 4 a d (+ (a + 2g) d when V is not expanded) + a (lse) [a s softmax: window]
    te attention     = 2 hs + (a + g) d + (a + 2g) d + a d          (q, k, QKV storage, output)
    local dense MLP  = 3 hs + 5 f (gated) | 3 hs + 2 f
    te dense MLP     = 2 hs + 3 f (gated) | 2 hs + 2 f
    MoE layer        = norm + router (E scores) + k * etp * (h + 6 f_e | h + 3 f_e + probs) per routed token

Recompute: ``full`` keeps only each checkpointed group's input (the group's activations are rebuilt, and
live, one group at a time). ``selective`` drops what megatron-core's checkpoint around each of
``train.recompute_modules`` frees (``selected_modules``; rebuilt one layer at a time in backward):

* ``core_attn``: core attention keeps its inputs, not its internals (``tensor_parallel.checkpoint``);
* ``layernorm``: a norm that is a module of its own (the local spec's two; TE's MLA input norm and MoE
  pre-MLP norm, the others being fused into TE's LayerNorm+Linear) keeps its input alone: its output, which
  the following linears kept, is discarded (``CheckpointWithoutOutput``) and rebuilt before their backward;
* ``mlp`` (dense layers only), ``moe`` (the whole MoE layer: router, dispatch, experts, combine, shared
  experts), ``shared_experts``: the block keeps its input alone;
* ``moe_act`` (TE grouped experts only): the probability-weighted SwiGLU output, FC2's input, is discarded;
* ``mla_up_proj``: the q/kv up-projections and RoPE keep their compressed inputs alone; their outputs, the
  q, k, v that core attention keeps, are discarded.

Dropout is off in our recipes, so no masks are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig

FP32 = 4
INT64 = 8
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def kernel_set(cfg: RunConfig) -> str:
    """``local`` on the CPU lane, ``te`` on GPU clusters (see the module docstring)."""
    return "local" if cfg.cluster.gpu_arch == "cpu" else "te"


@dataclass(frozen=True)
class Dims:
    """Sizes one rank sees for one microbatch."""

    batch: int  # micro batch size
    seq: int  # sequence per CP rank
    cp: int  # context-parallel degree
    sp: int  # divisor of tokens in the sequence-parallel region (tp with SP, else 1)
    tp: int
    heads: int  # per TP rank
    groups: int  # per TP rank
    head_dim: int
    hidden: int
    act: int  # bytes per activation element
    kernels: str

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def dims_of(cfg: RunConfig) -> Dims:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp = max(1, p.tp)
    groups = m.num_attention_heads if m.multi_latent_attention else m.num_query_groups
    return Dims(
        batch=t.micro_batch_size,
        seq=t.seq_length // max(1, p.cp),
        cp=max(1, p.cp),
        sp=tp if p.sp else 1,
        tp=tp,
        heads=m.num_attention_heads // tp,
        groups=max(1, groups // tp),
        head_dim=derived.head_dim(m),
        hidden=m.hidden_size,
        act=_DTYPE_BYTES.get(cfg.precision.params_dtype, 2),
        kernels=kernel_set(cfg),
    )


def linear_input_bytes(cfg: RunConfig, x: Dims) -> float:
    """Bytes per element a Transformer Engine linear keeps of its input: FP8/FP4 recipes keep the
    quantised copy (1 byte, scales aside), bf16 the input itself."""
    if x.kernels == "te" and (cfg.precision.fp8 or cfg.precision.fp4):
        return 1
    return x.act


def local_sdpa(cfg: RunConfig) -> bool:
    """The project's local spec computes core attention with torch SDPA, except for sliding windows
    (megatron-core's unfused path, which materialises the scores)."""
    return not cfg.model.sliding_window


def selected_modules(cfg: RunConfig, recompute: str | None = None) -> frozenset:
    """The modules selective recompute rebuilds (none unless ``recompute``, default the recipe's, is selective)."""
    rc = cfg.train.recompute if recompute is None else recompute
    return frozenset(cfg.train.recompute_modules) if rc == "selective" else frozenset()


def norm_apart(cfg: RunConfig, kernels: str, where: str) -> bool:
    """Whether a layer's norm before ``where`` (attention | mlp | moe) is a module of its own, which the
    ``layernorm`` module recomputes: always on the local spec; on TE's spec (gpt_layer_specs.py) the MLA
    input norm and an MoE layer's pre-MLP norm, the others being IdentityOp inside a LayerNorm+Linear."""
    if kernels == "local":
        return True
    return where == "moe" or (where == "attention" and bool(cfg.model.multi_latent_attention))


def idle_module(cfg: RunConfig, module: str) -> str | None:
    """Why ``module`` would recompute nothing in this model on its kernel set, or None when it does work."""
    m, kernels = cfg.model, kernel_set(cfg)
    moe_layers = sum(derived.is_moe_layer(m, i) for i in range(m.num_layers))
    if module == "mla_up_proj" and not m.multi_latent_attention:
        return "the model has no multi-latent attention (megatron-core refuses mla_up_proj without it)"
    if module in ("moe", "moe_act", "shared_experts") and not moe_layers:
        return "the model has no MoE layers"
    if module == "shared_experts" and not m.moe_shared_expert_intermediate_size:
        return "the model's MoE layers have no shared experts"
    if module == "mlp" and moe_layers == m.num_layers:
        return "every layer is an MoE layer and mlp recomputes dense MLPs only (moe, moe_act recompute experts)"
    if module == "moe_act" and kernels == "local":
        return ("the local spec's experts (SequentialMLP) have no grouped GEMM, and megatron-core refuses moe_act "
                "without moe_grouped_gemm (Transformer Engine's grouped experts here)")
    if module == "layernorm" and not any(norm_apart(cfg, kernels, w) for w in ("attention", "moe" if moe_layers else "mlp")):
        return "Transformer Engine's spec fuses this model's norms into the linears after them (no norm module)"
    return None


def norm_bytes(cfg: RunConfig, x: Dims, recomputed: bool = False) -> float:
    """Per token: a pre-norm plus the input the following linear keeps.

    Local: composite RMSNorm keeps its input, the normalised copy and rstd; the linear keeps the scaled
    output (LayerNorm is one fused op keeping input + mean/rstd). TE: the fused LayerNorm+Linear keeps
    the input and the normalised output. ``recomputed`` (``layernorm``): the input alone.
    """
    hs = x.hidden / x.sp
    if recomputed:
        return hs * x.act
    if x.kernels == "te":
        return hs * (x.act + linear_input_bytes(cfg, x)) + FP32 / x.sp
    if cfg.model.normalization == "LayerNorm":
        return 2 * hs * x.act + 2 * FP32 / x.sp
    return 3 * hs * x.act + FP32 / x.sp


def attention_bytes(cfg: RunConfig, x: Dims, modules: frozenset = frozenset()) -> float:
    """One self-attention block (its pre-norm included), one microbatch; ``modules``: those recomputed."""
    m, a, g, d = cfg.model, x.heads, x.groups, x.head_dim
    T = x.tokens
    # pre-norm + QKV linear input (saved sharded under SP)
    total = T * norm_bytes(cfg, x, "layernorm" in modules and norm_apart(cfg, x.kernels, "attention"))
    if m.multi_latent_attention:
        return total + _mla_bytes(cfg, x, modules)
    qkv_storage = (a + 2 * g) * d
    if x.kernels == "te":
        # flash attention keeps rope'd q and k, v (a view: the whole QKV output stays alive) and its
        # output, which linear_proj keeps too; q/k norms keep their normalised outputs
        per_token = (a + g) * d + qkv_storage + a * d
        if m.qk_layernorm:
            per_token += (a + g) * d + (a * d if a > g else 0)
        proj_copy = a * d * linear_input_bytes(cfg, x) if linear_input_bytes(cfg, x) != x.act else 0  # FP8 copy
        return total + T * (per_token * x.act + proj_copy + a * FP32)  # + softmax log-sum-exp
    # local spec: rope'd q; k and v expanded to all heads under GQA (v is a view of QKV under MHA)
    keeps_qkv = m.qk_layernorm or a == g
    per_token = a * d + a * d  # q, output (= linear_proj input)
    scores = 0.0
    if "core_attn" in modules:
        per_token += g * d  # checkpoint keeps rope'd k and the QKV storage (v's base)
        keeps_qkv = True
    elif x.cp > 1:
        # CP attention (models/context_parallel.py): k and v all-gathered over CP (then expanded to all
        # heads) span the whole sequence, cp x this rank's tokens; v no longer views the QKV output.
        # SDPA keeps its mask too: [s/cp, s], converted from bool to the activation dtype.
        per_token += 2 * x.cp * a * d
        keeps_qkv = m.qk_layernorm
        scores = T * a * FP32 + x.seq * x.seq * x.cp * x.act
    else:
        per_token += a * d if a > g else 0  # expanded v
        per_token += a * d  # k (expanded, or rope'd under MHA)
        if local_sdpa(cfg):
            scores = T * a * FP32  # SDPA keeps the log-sum-exp, not the scores
        else:
            scores = x.batch * a * x.seq * x.seq * x.act + x.seq * x.seq  # softmax output + causal mask
    if keeps_qkv:
        per_token += qkv_storage
    norm_stats = 0.0
    if m.qk_layernorm:
        # normalised q and k; the q norm's input is a copy under GQA (reshaped out of the fused QKV)
        per_token += (a + g) * d + (a * d if a > g else 0)
        norm_stats = (a + g) * FP32  # their rstd, one per head
    rope = 4 * x.seq * d * x.act if m.position_embedding_type == "rope" else 0
    return total + T * (per_token * x.act + norm_stats) + scores + rope


def _mla_bytes(cfg: RunConfig, x: Dims, modules: frozenset = frozenset()) -> float:
    """MLA after its input norm, one microbatch: latents, their norms, up-projected q/k/v, output.

    ``mla_up_proj`` (multi_latent_attention.py: ``CheckpointWithoutOutput`` around the up-projections and RoPE)
    keeps its inputs (the latents) and discards the q, k, v it returns, which core attention kept."""
    m, a = cfg.model, x.heads
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    up = "mla_up_proj" in modules
    out = a * m.v_head_dim  # attention output = linear_proj input
    if x.kernels == "local":
        return x.tokens * _local_mla_per_token(cfg, x, up) + _local_mla_per_sequence(cfg, x, modules)
    latents = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim  # down-projection outputs
    if up:
        return x.tokens * (latents + out) * x.act
    per = 3 * latents  # down-proj outputs, normalised latents, up-proj inputs
    per += a * q_head * 2 + a * (m.qk_head_dim + m.v_head_dim) + a * q_head  # q, kv up-proj, k with rope
    return x.tokens * (per + out) * x.act


def _local_mla_per_token(cfg: RunConfig, x: Dims, up: bool) -> float:
    """The local spec's MLA per token: down-projection outputs, the q/kv norms (separate modules: input,
    normalised copy, the scaled output the up-projection keeps, rstd), the q, k, v core attention keeps
    (``mla_up_proj`` discards them) and its output."""
    m, a = cfg.model, x.heads
    norms = 2 if m.qk_layernorm else 0
    per = (m.q_lora_rank or 0) * (1 + norms) + m.kv_lora_rank * (1 + norms) + m.qk_pos_emb_head_dim
    stats = (int(bool(m.q_lora_rank)) + 1) * FP32 if m.qk_layernorm else 0
    qkv = 0 if up else 2 * a * (m.qk_head_dim + m.qk_pos_emb_head_dim) + a * m.v_head_dim
    return (per + qkv + a * m.v_head_dim) * x.act + stats


def _local_mla_per_sequence(cfg: RunConfig, x: Dims, modules: frozenset) -> float:
    """RoPE's cos/sin of q and k (the up-projection checkpoint keeps the frequencies alone) and megatron-core's
    unfused attention (q/k and v head sizes differ: no SDPA), whose softmax output and causal mask stay
    (``core_attn`` recomputes them)."""
    m = cfg.model
    rope = (1 if "mla_up_proj" in modules else 4) * x.seq * m.qk_pos_emb_head_dim * x.act
    if "core_attn" in modules:
        return rope
    return rope + x.batch * x.heads * x.seq * x.seq * x.act + x.seq * x.seq


def mlp_bytes(cfg: RunConfig, x: Dims, ffn: int, with_norm: bool = True, modules: frozenset = frozenset(),
              recomputed: bool = False) -> float:
    """A (gated) MLP with FFN width ``ffn`` split over TP, with or without its pre-norm; ``recomputed``: the
    block under ``tensor_parallel.checkpoint`` (``mlp``, ``shared_experts``), which keeps its input alone."""
    norm = norm_bytes(cfg, x, "layernorm" in modules and norm_apart(cfg, x.kernels, "mlp")) if with_norm else 0.0
    if recomputed:  # TE: the norm is inside the checkpoint (fused into FC1), local: before it (its output kept)
        return x.tokens * (x.hidden / x.sp * x.act if x.kernels == "te" and with_norm else norm)
    f = ffn / x.tp
    gated = cfg.model.activation == "swiglu"
    if x.kernels == "te":  # fused SwiGLU keeps FC1's output; FC2 keeps its input (FP8 under FP8 recipes)
        total = x.tokens * ((2 * f if gated else f) * x.act + f * linear_input_bytes(cfg, x))
    else:
        inner = 5 * f if gated else 2 * f  # + SiLU output and the linear half (x + offset)
        total = x.tokens * inner * x.act
    return total + x.tokens * norm


def moe_bytes(cfg: RunConfig, x: Dims, modules: frozenset = frozenset()) -> float:
    """An MoE block: pre-norm (its output feeds router, experts and shared experts), router, experts;
    ``modules``: those recomputed (``moe`` keeps the norm's output, the checkpoint's input, alone)."""
    m = cfg.model
    etp = derived.expert_tensor_parallel_size(cfg)
    experts, k = m.num_moe_experts, m.moe_router_topk
    local_tokens = x.tokens / x.sp  # tokens this rank routes (SP shards them over TP)
    ln = "layernorm" in modules
    total = x.tokens * norm_bytes(cfg, x, ln)  # the pre-MLP norm is a module of its own
    if "moe" in modules:  # the checkpoint keeps the norm's output (discarded under layernorm) as it is, not quantised
        return total + (0.0 if ln else x.tokens * x.hidden / x.sp * (x.act - linear_input_bytes(cfg, x)))
    total += local_tokens * (experts * (FP32 + 1) + k * (FP32 + 2 * INT64))  # scores, mask, top-k
    routed = local_tokens * k * etp  # tokens this rank's experts process, on average
    f_e = (m.moe_ffn_hidden_size or m.ffn_hidden_size) / etp
    # local: permuted input, FC1 output, SiLU, linear half, prob-weighted product; te: grouped GEMMs
    if x.kernels == "local":
        total += routed * (x.hidden + 6 * f_e) * x.act
    else:  # grouped GEMMs keep their inputs (quantised under FP8/FP4); the probability-weighted SwiGLU keeps
        # FC1's output and the probabilities (megatron-core applies them there; unpermute keeps no tokens)
        lib = linear_input_bytes(cfg, x)
        fc2_input = 0 if "moe_act" in modules else f_e * lib  # moe_act discards it (FP8: its original input)
        total += routed * (x.hidden * lib + fc2_input + 2 * f_e * x.act + FP32)
    if m.moe_shared_expert_intermediate_size:
        total += mlp_bytes(cfg, x, m.moe_shared_expert_intermediate_size, with_norm=False,
                           recomputed="shared_experts" in modules)
    return total


def layer_bytes(cfg: RunConfig, layer: int, recompute: str | None = None) -> float:
    """Activations one transformer layer saves for one microbatch (no full recompute)."""
    return kind_bytes(cfg, derived.is_moe_layer(cfg.model, layer), recompute)


def kind_bytes(cfg: RunConfig, moe: bool, recompute: str | None = None) -> float:
    x = dims_of(cfg)
    mods = selected_modules(cfg, recompute)
    attn = attention_bytes(cfg, x, mods)
    if moe:
        return attn + moe_bytes(cfg, x, mods)
    return attn + mlp_bytes(cfg, x, cfg.model.ffn_hidden_size, modules=mods, recomputed="mlp" in mods)


def layers_bytes(cfg: RunConfig, layers: List[int], recompute: str | None = None) -> float:
    """Sum of ``layer_bytes`` over ``layers``, one evaluation per layer kind."""
    n_moe = sum(derived.is_moe_layer(cfg.model, i) for i in layers)
    total = (len(layers) - n_moe) * kind_bytes(cfg, False, recompute) if len(layers) > n_moe else 0.0
    return total + (n_moe * kind_bytes(cfg, True, recompute) if n_moe else 0.0)


def embedding_bytes(cfg: RunConfig) -> float:
    x = dims_of(cfg)
    return x.tokens * INT64  # token ids kept by the embedding lookup


def head_bytes(cfg: RunConfig) -> float:
    """Final norm, output layer input, fp32 softmax of the vocab shard, labels and loss mask."""
    x = dims_of(cfg)
    vocab = derived.padded_vocab_size(cfg.model, x.tp) / x.tp
    norm = x.tokens * norm_bytes(cfg, x)
    return norm + x.tokens * (x.hidden / x.sp * x.act + vocab * FP32 + INT64 + 1)


def checkpoint_groups(cfg: RunConfig, chunk_layers: int) -> tuple[int, int]:
    """Full recompute of one model chunk: (checkpointed groups, layers left un-recomputed)."""
    t = cfg.train
    n = max(1, t.recompute_num_layers)
    if t.recompute_method == "block":
        recomputed = min(n, chunk_layers)
        return recomputed, chunk_layers - recomputed  # block: one checkpoint per recomputed layer
    return -(-chunk_layers // n), 0


def chunk_bytes(cfg: RunConfig, layers: List[int], first: bool, last: bool) -> float:
    """Saved bytes for one microbatch through one model chunk, recompute policy applied."""
    x = dims_of(cfg)
    total = embedding_bytes(cfg) if first else 0.0
    total += head_bytes(cfg) if last else 0.0
    if cfg.train.recompute != "full":
        return total + layers_bytes(cfg, layers)
    groups, plain = checkpoint_groups(cfg, len(layers))
    total += groups * x.tokens * x.hidden / x.sp * x.act  # each checkpoint keeps its input
    return total + layers_bytes(cfg, layers[len(layers) - plain :], "none")


def recompute_transient_bytes(cfg: RunConfig, layers: List[int]) -> float:
    """Full recompute rebuilds one group's activations during backward: that much is live at once; selective
    recompute rebuilds what it dropped of one layer at most (its modules in turn, during that layer's backward)."""
    if not layers or cfg.train.recompute == "none":
        return 0.0
    if cfg.train.recompute == "selective":
        kinds = {derived.is_moe_layer(cfg.model, i) for i in layers}
        return max(kind_bytes(cfg, moe, "none") - kind_bytes(cfg, moe) for moe in kinds)
    n = 1 if cfg.train.recompute_method == "block" else max(1, cfg.train.recompute_num_layers)
    kinds = {derived.is_moe_layer(cfg.model, i) for i in layers}
    return max(kind_bytes(cfg, moe, "none") for moe in kinds) * min(n, len(layers))
