"""An analytic step-time model, checked against published measurements (``tests/test_published.py``).

Per training step, on the slowest pipeline stage:

    step = (M + (pp - 1) / vpp) * (t_gemm + t_attn + t_mem + t_tp + t_cp + t_ep + t_pp) + t_dp + t_opt

* ``t_gemm``: linear-layer FLOPs of one microbatch on the stage (top-k experts only; full recompute adds the
  layer's forward again, selective recompute its modules' forward: ``cost.recomputed_forward_parts``) at
  ``peak(format) x GEMM_EFFICIENCY[format] x size factor`` (``rates.py``); the output layer and router run
  in bf16, the transformer layers' GEMMs in the recipe's format (bf16, FP8, FP4).
  An MTP layer counts as a layer like the last plus its ``2h -> h`` projection on its stage, and its own
  logits on the last stage.
* ``t_attn``: causal core attention, ``s/2 * heads * (d_qk + d_v) * 2`` FLOPs per token forward (half of
  the full square: flash attention skips masked tiles), in bf16 at ``ATTENTION_EFFICIENCY`` (times
  ``CP_ATTENTION_FACTOR`` under context parallelism).
* ``t_mem``: memory-bound kernels (norms, RoPE, SwiGLU, casts, MoE permutation) as ``MEMORY_PASSES`` x
  the activation bytes the stage's layers save per microbatch without recompute (a third more when
  full recompute runs their forward again; with selective recompute the bytes it rebuilds once more), at
  the HBM bandwidth.
* ``t_tp``: with SP, 4 all-gathers/reduce-scatters forward and 4 backward per layer of the ``tokens x
  hidden`` activation (6+6 where full recompute repeats the forward; 2 more per recomputed dense MLP or
  MoE layer), ``TP_EXPOSED`` of it not hidden. Recomputing whole MoE layers (``moe``) repeats their
  forward dispatch and combine: ``t_ep`` x 1.5.
* ``t_cp``: ``p2p``: each rank's K/V chunk moves ``cp - 1`` times forward and ``2 (cp - 1)`` backward,
  hidden behind the attention it overlaps with; ``all_gather``: the same volume as all-gather +
  reduce-scatter, exposed; ``a2a``: Q, K, V and the output re-sharded forward and backward, exposed.
* ``t_ep``: per MoE layer, dispatch + combine forward and backward of ``k`` copies of each local token,
  ``(ep - 1) / ep`` of them leaving the rank, over the slower link used, blocking at
  ``ALL_TO_ALL_EFFICIENCY``; with ``overlap_moe_expert_parallel_comm`` only what the other micro-batch's
  computation does not hide (``moe_comm.py``: the combined 1F1B schedule, stream by stream).
* ``t_pp``: activation send forward + gradient send backward per microbatch and model chunk, hidden
  under the interleaved schedule (``PP_EXPOSED_INTERLEAVED``).
* ``t_dp``: reduce-scatter of gradients + all-gather of parameters (distributed optimizer) or an
  all-reduce, over DP x CP (expert-DP for experts); with ``overlap_grad_reduce`` only what does not hide
  behind the last microbatch's backward is exposed. ``t_opt``: the optimizer step streams its state.

Bandwidths: NVLink when a group stays inside an NVLink domain, else the per-GPU network figure, both
times ``LINK_EFFICIENCY``. CPU clusters (no peak given) use nominal rates: times are relative only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate import activations, cost, moe_comm, rates, schedule
from megatron_recipes.estimate.cost import kind_forward_parts
from megatron_recipes.estimate.groups import build_group_map
from megatron_recipes.estimate.params import stage_params

NOMINAL_TFLOPS, NOMINAL_BW_GBPS = rates.NOMINAL_TFLOPS, rates.NOMINAL_BW_GBPS
_ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TERMS = ("gemm", "attention", "memory", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer")


@dataclass(frozen=True)
class StepTime:
    gemm: float  # seconds per step, all microbatches, bubble excluded
    attention: float
    memory: float
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float  # exposed
    optimizer: float
    tokens_per_step: int
    world: int
    model_flops_per_token: float
    peak_flops: float  # bf16 dense peak, the MFU denominator
    nominal: bool  # True when the cluster gave no peak (CPU): a relative figure
    tp_unoverlapped: float = 0.0  # TP time had nothing been overlapped (our trainer today)
    ep_blocking: float = 0.0  # EP all-to-all per step as blocking exchanges (== ``ep`` without the overlap)
    ep_transfer: float = 0.0  # overlapped: the EP transfers' own time per step on the links...
    ep_hidden: float = 0.0  # ...and the part of it hidden behind the other micro-batch's computation
    spread: float = 0.0  # relative uncertainty of the throughput
    assumptions: List[str] = field(default_factory=list)

    @property
    def compute(self) -> float:
        return self.gemm + self.attention + self.memory

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in TERMS)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.total / self.world

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) per second over the bf16 dense peak, as NVIDIA's tables count."""
        return self.model_flops_per_token * self.tokens_per_step / (self.total * self.world * self.peak_flops)

    def breakdown(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in TERMS}

    def dominant(self, n: int = 3) -> List[tuple[str, float]]:
        """The ``n`` largest terms with their share of the step."""
        parts = sorted(self.breakdown().items(), key=lambda kv: -kv[1])
        return [(k, v / self.total) for k, v in parts[:n] if v > 0]


def _smallest_gemm_dim(cfg: RunConfig, moe: bool) -> float:
    """The thinnest dimension of the layer's GEMMs on one rank (tokens per expert for MoE layers)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * t.seq_length / p.cp
    dims = [m.hidden_size / p.tp, tokens]
    if moe:
        etp = derived.expert_tensor_parallel_size(cfg)
        per_expert = tokens * m.moe_router_topk * p.ep / (p.tp if p.sp else 1) / m.num_moe_experts
        dims += [(m.moe_ffn_hidden_size or m.ffn_hidden_size) / etp, per_expert]
    else:
        dims.append(m.ffn_hidden_size / p.tp)
    return min(dims)


def _layer_forward(cfg: RunConfig, moe: bool, peak_bf16: float, peak_fmt: float) -> tuple[float, float, float, float, float]:
    """(attention GEMMs, core attention, attention-side memory, MLP GEMMs, MLP-side memory) seconds of one
    microbatch's forward through one layer of a kind on one GPU; backward repeats each twice."""
    m, t = cfg.model, cfg.train
    tokens, width = t.micro_batch_size * t.seq_length, cfg.parallel.tp * cfg.parallel.cp
    gemm_rate, attn_rate, per_byte = _rates(cfg, moe, peak_bf16, peak_fmt)
    attn_mm, mlp_mm, core = kind_forward_parts(m, moe, t.seq_length)
    layer_bytes = activations.kind_bytes(cfg, moe, "none")  # traffic of one forward
    attn_bytes = activations.attention_bytes(cfg, activations.dims_of(cfg))
    return (attn_mm * tokens / width / gemm_rate, core * tokens / width / attn_rate, attn_bytes * per_byte,
            mlp_mm * tokens / width / gemm_rate, (layer_bytes - attn_bytes) * per_byte)


def _rates(cfg: RunConfig, moe: bool, peak_bf16: float, peak_fmt: float) -> tuple[float, float, float]:
    """(GEMM FLOP/s, core-attention FLOP/s, seconds per activation byte of one forward) of a layer kind."""
    p = cfg.parallel
    fmt = rates.gemm_format(cfg)
    gemm_rate = peak_fmt * rates.GEMM_EFFICIENCY[fmt] * rates.gemm_size_factor(_smallest_gemm_dim(cfg, moe))
    attn_rate = peak_bf16 * rates.ATTENTION_EFFICIENCY * (rates.CP_ATTENTION_FACTOR if p.cp > 1 else 1.0)
    hbm = cfg.cluster.hbm_bw_gbps * 1e9 * rates.HBM_EFFICIENCY if cfg.cluster.hbm_bw_gbps > 0 else NOMINAL_BW_GBPS * 1e9
    return gemm_rate, attn_rate, rates.MEMORY_PASSES / 3.0 / hbm  # the forward's third of the memory passes


def _recomputed_forward(cfg: RunConfig, moe: bool, peak_bf16: float, peak_fmt: float) -> tuple[float, float, float]:
    """(GEMM, core attention, memory) seconds of the forward selective recompute runs again in one layer's
    backward: its modules' FLOPs (``cost.recomputed_forward_parts``) and the activations they rebuild, which
    are what they dropped (``activations``), at the memory passes' rate."""
    mods = activations.selected_modules(cfg)
    if not mods:
        return 0.0, 0.0, 0.0
    t = cfg.train
    tokens, width = t.micro_batch_size * t.seq_length, cfg.parallel.tp * cfg.parallel.cp
    gemm_rate, attn_rate, per_byte = _rates(cfg, moe, peak_bf16, peak_fmt)
    mm, core = cost.recomputed_forward_parts(cfg.model, moe, t.seq_length, mods)
    rebuilt = activations.kind_bytes(cfg, moe, "none") - activations.kind_bytes(cfg, moe)
    return mm * tokens / width / gemm_rate, core * tokens / width / attn_rate, rebuilt * per_byte


def _stage_compute(cfg: RunConfig, pp_rank: int, peak_bf16: float, peak_fmt: float) -> tuple[float, float, float]:
    """(gemm, attention, memory) seconds for one microbatch through one stage on one GPU."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch_size * t.seq_length
    width = p.tp * p.cp
    kinds = (False, True) if derived.is_moe(m) else (False,)
    fwd = {moe: _layer_forward(cfg, moe, peak_bf16, peak_fmt) for moe in kinds}
    again = {moe: _recomputed_forward(cfg, moe, peak_bf16, peak_fmt) for moe in kinds}  # selective recompute
    gemm = attn = memory = 0.0
    for chunk in derived.pipeline_stage_layers(cfg)[pp_rank]:
        recomputed = len(chunk)
        if t.recompute == "full" and t.recompute_method == "block":
            recomputed = min(len(chunk), max(1, t.recompute_num_layers))
        for j, i in enumerate(chunk):
            a_mm, core, a_mem, m_mm, m_mem = fwd[derived.is_moe_layer(m, i)]
            r_mm, r_core, r_mem = again[derived.is_moe_layer(m, i)]
            passes = 3.0 + (1.0 if t.recompute == "full" and j < recomputed else 0.0)
            gemm += passes * (a_mm + m_mm) + r_mm
            attn += passes * core + r_core
            memory += passes * (a_mem + m_mem) + r_mem
    mtp = m.mtp_num_layers or 0
    if mtp and pp_rank == derived.mtp_pipeline_rank(cfg):  # MTP: a layer like the last and the 2h -> h projection
        a_mm, core, a_mem, m_mm, m_mem = fwd[derived.is_moe_layer(m, m.num_layers - 1)]
        r_mm, r_core, r_mem = again[derived.is_moe_layer(m, m.num_layers - 1)]
        proj = 2.0 * 2 * m.hidden_size * m.hidden_size * tokens / width / (peak_bf16 * rates.GEMM_EFFICIENCY["bf16"])
        gemm += mtp * (3.0 * (a_mm + m_mm + proj) + r_mm)
        attn += mtp * (3.0 * core + r_core)
        memory += mtp * (3.0 * (a_mem + m_mem) + r_mem)
    if pp_rank == max(1, p.pp) - 1:  # output layer, bf16 (once more per MTP layer: each computes its own logits)
        head = 3.0 * (1 + mtp) * cost.logits_forward_flops(cfg) * tokens / width
        gemm += head / (peak_bf16 * rates.GEMM_EFFICIENCY["bf16"])
    return gemm, attn, memory


def _moe_sides(cfg: RunConfig, peak_bf16: float, peak_fmt: float, tp_per_layer: float) -> moe_comm.LayerSides:
    """An MoE layer's forward split as the combined 1F1B schedule runs it (TP collectives on the attention side)."""
    a_mm, core, a_mem, m_mm, m_mem = _layer_forward(cfg, True, peak_bf16, peak_fmt)
    return moe_comm.LayerSides(attn=a_mm + core + a_mem + tp_per_layer / 3, mlp=m_mm + m_mem)


def _bandwidth(cfg: RunConfig, kind: str, groups) -> float:
    c = cfg.cluster
    intra = groups[kind].intra_nvlink if kind in groups else True
    bw = c.intra_node_bw_gbps if intra else c.inter_node_bw_gbps
    return (bw if bw > 0 else NOMINAL_BW_GBPS) * 1e9 * rates.LINK_EFFICIENCY


def estimate_step_time(cfg: RunConfig, groups=None) -> StepTime:
    """The model above for a validated layout (``groups``: a prebuilt group map, to save time)."""
    groups = groups if groups is not None else build_group_map(cfg)
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    nominal = c.peak_bf16_tflops <= 0
    peak_bf16 = (NOMINAL_TFLOPS if nominal else c.peak_bf16_tflops) * 1e12
    fmt = rates.gemm_format(cfg)
    assumptions: List[str] = []
    peak_fmt = rates.peak_tflops(cfg, fmt) * 1e12
    if peak_fmt <= 0:
        peak_fmt = peak_bf16
        if not nominal and fmt != "bf16":
            assumptions.append(f"cluster {c.name} gives no {fmt} peak: its GEMMs counted at the bf16 rate")
    pp, vpp = max(1, p.pp), derived.virtual_pipeline_size(cfg)
    act = _ACT_BYTES.get(cfg.precision.params_dtype, 2)
    micro = max(1, derived.num_microbatches(cfg))
    tokens_local = t.micro_batch_size * t.seq_length / p.cp  # per CP rank
    layers_per_stage = max(len(derived.layers_on_pipeline_rank(cfg, r)) for r in range(pp))
    moe_layers = max(sum(derived.is_moe_layer(m, i) for i in derived.layers_on_pipeline_rank(cfg, r)) for r in range(pp))

    per_stage = [_stage_compute(cfg, r, peak_bf16, peak_fmt) for r in range(pp)]
    gemm, attn, mem = max(per_stage, key=sum)
    activation = tokens_local * m.hidden_size * act
    tp_full = 0.0
    if p.tp > 1:
        collective = (p.tp - 1) / p.tp * activation
        repeats = 4 * _recomputed_share(cfg) + _selective_collectives(cfg)
        tp_full = (8 + repeats) * collective * layers_per_stage / _bandwidth(cfg, "tp", groups)
    tp = tp_full * rates.TP_EXPOSED
    cp = _cp_time(cfg, groups, attn, layers_per_stage, tokens_local, act)
    ep = ep_hidden = ep_blocking = ep_transfer = 0.0
    if derived.is_moe(m) and p.ep > 1:
        blocking = moe_comm.blocking_time(cfg, groups, tokens_local, act)
        sides = _moe_sides(cfg, peak_bf16, peak_fmt, tp / max(1, layers_per_stage))
        transfer = moe_comm.transfer_time(cfg, groups, tokens_local, act)
        ep, ep_hidden = moe_comm.exposed_time(cfg, sides, blocking, transfer, moe_layers)
        ep_blocking = moe_layers * blocking
        if "moe" in activations.selected_modules(cfg):  # the recomputed MoE forward dispatches and combines again
            ep, ep_blocking = 1.5 * ep, 1.5 * ep_blocking  # (rule recompute.moe_with_ep_overlap: no overlap here)
        ep_transfer = moe_layers * transfer if p.overlap_moe_expert_parallel_comm else 0.0
    pp_comm = 2 * vpp * activation / (p.tp if p.sp else 1) / _bandwidth(cfg, "pp", groups) if pp > 1 else 0.0
    if vpp > 1 and not nominal:
        pp_comm *= rates.PP_EXPOSED_INTERLEAVED
    per_micro = gemm + attn + mem + tp + cp + ep + pp_comm
    dp = _dp_exposed(cfg, groups, per_micro)
    spread, why = rates.spread(cfg)
    assumptions += why
    if m.num_moe_experts:
        assumptions.append("experts evenly loaded (the published runs force-balance tokens)")
        if p.ep > 1:
            assumptions.append(
                "flex dispatcher: a token crosses the network once per remote NVLink domain of its experts"
                if p.moe_dispatcher == "flex" else
                f"{p.moe_dispatcher} dispatcher: each of a token's {m.moe_router_topk} copies travels to its expert's "
                "rank (parallel.moe_dispatcher=flex deduplicates copies per NVLink domain)"
            )
            if p.overlap_moe_expert_parallel_comm:
                assumptions.append(
                    f"EP overlap: blocking exchanges at {rates.ALL_TO_ALL_EFFICIENCY:.0%} of the link (calibrated, the "
                    f"waiting included), overlapped transfers at {rates.LINK_EFFICIENCY:.0%}; computation not slowed by "
                    "the communication kernels beside it")
    if p.tp > 1:
        assumptions.append(
            f"TP communication {rates.TP_EXPOSED:.0%} exposed, as with Transformer Engine's tp_comm_overlap in the "
            f"published runs; the trainer here does not overlap it (+{micro * (tp_full - tp):.3g}s per step)"
        )
    return StepTime(
        gemm=micro * gemm,
        attention=micro * attn,
        memory=micro * mem,
        bubble=schedule.bubble_slots(cfg) * per_micro,
        tp=micro * tp,
        cp=micro * cp,
        ep=micro * ep,
        pp=micro * pp_comm,
        dp=dp,
        optimizer=_optimizer_time(cfg),
        tokens_per_step=t.global_batch_size * t.seq_length,
        world=derived.world_size(cfg),
        model_flops_per_token=cost.flops_per_token(cfg),
        peak_flops=peak_bf16,
        nominal=nominal,
        tp_unoverlapped=micro * tp_full,
        ep_blocking=micro * ep_blocking,
        ep_transfer=micro * ep_transfer,
        ep_hidden=micro * ep_hidden,
        spread=spread,
        assumptions=assumptions,
    )


def _cp_time(cfg: RunConfig, groups, attn: float, layers: int, tokens_local: float, act: int) -> float:
    """Context-parallel communication per microbatch left exposed, by ``parallel.cp_comm_type``."""
    m, p = cfg.model, cfg.parallel
    if p.cp < 2:
        return 0.0
    kv_heads = (m.num_attention_heads if m.multi_latent_attention else m.num_query_groups) / p.tp
    kv = 2 * max(kv_heads, 1) * derived.head_dim(m) * tokens_local * act  # this rank's K and V chunk
    bw = _bandwidth(cfg, "cp", groups)
    if p.cp_comm_type in ("p2p", "a2a+p2p"):
        comm = 3 * (p.cp - 1) * kv * layers / bw
        return max(0.0, comm - rates.CP_P2P_OVERLAP * attn)
    if p.cp_comm_type == "all_gather":
        return 3 * (p.cp - 1) * kv * layers / bw  # all-gather K/V forward, again + reduce-scatter backward
    # a2a (Ulysses): Q, K, V in and the output back, forward and backward
    qkvo = (2 * m.num_attention_heads / p.tp + 2 * max(kv_heads, 1)) * derived.head_dim(m) * tokens_local * act
    return 2 * (p.cp - 1) / p.cp * qkvo * layers / bw


def _recomputed_share(cfg: RunConfig) -> float:
    """Share of layers whose forward runs twice (full recompute; block method: the first N per chunk)."""
    t = cfg.train
    if t.recompute != "full":
        return 0.0
    if t.recompute_method != "block":
        return 1.0
    chunks = [len(c) for stage in derived.pipeline_stage_layers(cfg) for c in stage if len(c)]
    return sum(min(n, max(1, t.recompute_num_layers)) for n in chunks) / max(1, sum(chunks))


def _selective_collectives(cfg: RunConfig) -> float:
    """Per layer on average, the TP collectives selective recompute repeats: a recomputed dense MLP (``mlp``) or
    MoE layer (``moe``) gathers and reduce-scatters its block again; ``mla_up_proj`` gathers the latents again."""
    mods, m = activations.selected_modules(cfg), cfg.model
    if not mods:
        return 0.0
    moe = [derived.is_moe_layer(m, i) for i in range(m.num_layers)]
    blocks = sum(("moe" in mods) if is_moe else ("mlp" in mods) for is_moe in moe)
    latents = (m.q_lora_rank or 0) + (m.kv_lora_rank or 0) if m.multi_latent_attention and "mla_up_proj" in mods else 0
    return 2.0 * blocks / m.num_layers + latents / m.hidden_size


def _largest_stage(cfg: RunConfig):
    return max((stage_params(cfg, r) for r in range(max(1, cfg.parallel.pp))), key=lambda c: c.total)


def _optimizer_time(cfg: RunConfig) -> float:
    """Adam streams grads, fp32 master weights and both moments of this rank's shard (read + write)."""
    if cfg.cluster.hbm_bw_gbps <= 0:
        return 0.0
    params = _largest_stage(cfg)
    shards = max(1, derived.data_parallel_size(cfg) * cfg.parallel.cp) if cfg.optimizer.use_distributed_optimizer else 1
    eshards = max(1, derived.expert_data_parallel_size(cfg)) if cfg.optimizer.use_distributed_optimizer else 1
    local = params.dense / shards + params.expert / eshards
    return local * 2 * 16 / (cfg.cluster.hbm_bw_gbps * 1e9 * rates.HBM_EFFICIENCY)


def _dp_exposed(cfg: RunConfig, groups, per_micro: float) -> float:
    """Gradient reduce + parameter gather time per step not hidden behind compute."""
    prec, p = cfg.precision, cfg.parallel
    params = _largest_stage(cfg)
    grad = 4 if (prec.grad_reduce_in_fp32 or prec.params_dtype == "fp32") else 2
    weight = 1 if prec.fp8_param_gather else _ACT_BYTES.get(prec.params_dtype, 2)
    # distributed optimizer: reduce-scatter grads + all-gather params; plain DDP: all-reduce grads
    per_param = (grad + weight) if cfg.optimizer.use_distributed_optimizer else 2 * grad

    def volume(n_params: float, size: int) -> float:
        return n_params * per_param * (size - 1) / size if size > 1 else 0.0

    dense = volume(params.dense, derived.data_parallel_size(cfg) * p.cp) / _bandwidth(cfg, "dp_cp", groups)
    expert = volume(params.expert, derived.expert_data_parallel_size(cfg)) / _bandwidth(cfg, "edp", groups)
    total = dense + expert
    return max(0.0, total - per_micro) if p.overlap_grad_reduce else total
