"""An analytic step-time model, used to rank layouts (not to promise throughput).

Model, per training step on the slowest pipeline stage:

    step = (M + (pp - 1) / vpp) * (t_compute + t_tp + t_cp + t_ep + t_pp)  +  t_dp_exposed

* ``t_compute``: FLOPs of one microbatch on the stage / (tp * cp) at ``ASSUMED_MFU`` x the cluster's
  ``peak_bf16_tflops``. FLOPs: 2 per weight per token for every matmul (top-k experts only), causal
  attention ``s * heads * (d_qk + d_v)`` per token, the logits; backward = 2 x forward; full recompute
  adds one forward of the layers, selective one forward of core attention. FP8/FP4 are counted at the
  bf16 rate (conservative).
* ``t_tp``: per layer, 4 all-reduce-equivalents of the ``tokens x hidden`` activation (2 forward,
  2 backward; 6 with full recompute), each moving ``2 (tp - 1) / tp`` of it, not overlapped.
* ``t_cp``: per layer, each rank's K/V chunk passes ``cp - 1`` times forward and twice as much backward.
* ``t_ep``: per MoE layer, token dispatch + combine (all-to-all, forward and backward) of ``k`` copies
  of each local token, ``(ep - 1) / ep`` of it leaving the rank.
* ``t_pp``: activation send forward + gradient send backward per microbatch and model chunk.
* ``t_dp``: distributed optimizer reduce-scatter of fp32 (or bf16) grads + all-gather of parameters
  over DP x CP (expert-DP for experts); with ``parallel.overlap_grad_reduce`` only what does not hide
  behind one microbatch's compute is exposed.

Each communication uses the cluster's NVLink bandwidth when its group stays inside an NVLink domain,
else the per-GPU network bandwidth. CPU clusters (no peak given) use nominal rates: times are relative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megatron_recipes.config import derived
from megatron_recipes.config.schema import ModelConfig, RunConfig
from megatron_recipes.topology import schedule
from megatron_recipes.topology.params import Shard, attention_params, mlp_params, stage_params

ASSUMED_MFU = 0.5  # share of peak bf16 FLOP/s that the matmuls sustain
NOMINAL_TFLOPS = 1.0  # CPU clusters: relative ranking only
NOMINAL_BW_GBPS = 10.0
_ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds per step, bubble excluded
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    dp: float  # exposed
    tokens_per_step: int
    world: int
    model_flops_per_token: float
    peak_flops: float
    nominal: bool  # True when the cluster gave no peak (CPU): a relative figure

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.cp + self.ep + self.pp + self.dp

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.total / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_step / (self.total * self.world * self.peak_flops)

    def breakdown(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in ("compute", "bubble", "tp", "cp", "ep", "pp", "dp")}


def _attention_core_flops(m: ModelConfig, seq: int) -> float:
    """Causal QK^T and PV per token (forward)."""
    if m.multi_latent_attention:
        d_qk, d_v = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        d_qk = d_v = derived.head_dim(m)
    return seq * m.num_attention_heads * (d_qk + d_v)


def layer_forward_flops(m: ModelConfig, layer: int, seq: int) -> tuple[float, float]:
    """(matmul FLOPs, core-attention FLOPs) per token of one layer's forward, whole model width."""
    return kind_forward_flops(m, derived.is_moe_layer(m, layer), seq)


def kind_forward_flops(m: ModelConfig, moe: bool, seq: int) -> tuple[float, float]:
    full = Shard(te_spec=True)
    attn = attention_params(m, full, with_norm=False)
    if moe:
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        mlp = m.num_moe_experts * m.hidden_size + m.moe_router_topk * mlp_params(m, moe_ffn, 1, with_norm=False)
        if m.moe_shared_expert_intermediate_size:
            mlp += mlp_params(m, m.moe_shared_expert_intermediate_size, 1, with_norm=False)
    else:
        mlp = mlp_params(m, m.ffn_hidden_size, 1, with_norm=False)
    return 2.0 * (attn + mlp), float(_attention_core_flops(m, seq))


def model_flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token (forward + backward, no recompute), the MFU numerator."""
    m, s = cfg.model, cfg.train.seq_length
    n_moe = sum(derived.is_moe_layer(m, i) for i in range(m.num_layers))
    fwd = sum(kind_forward_flops(m, False, s)) * (m.num_layers - n_moe) + (sum(kind_forward_flops(m, True, s)) * n_moe if n_moe else 0)
    fwd += 2.0 * m.hidden_size * m.vocab_size
    return 3.0 * fwd


def _stage_compute_flops(cfg: RunConfig, pp_rank: int) -> float:
    """Training FLOPs of one microbatch through one stage, recompute included, whole TP x CP group."""
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * t.seq_length
    total = 0.0
    kinds = {moe: kind_forward_flops(m, moe, t.seq_length) for moe in {derived.is_moe_layer(m, i) for i in range(m.num_layers)}}
    for chunk in derived.pipeline_stage_layers(cfg)[pp_rank]:
        recomputed = len(chunk)
        if t.recompute == "full" and t.recompute_method == "block":
            recomputed = min(len(chunk), max(1, t.recompute_num_layers))
        for j, i in enumerate(chunk):
            mm, core = kinds[derived.is_moe_layer(m, i)]
            if t.recompute == "full" and j < recomputed:
                extra = mm + core
            else:
                extra = core if t.recompute == "selective" else 0.0
            total += 3.0 * (mm + core) + extra
    if pp_rank == max(1, cfg.parallel.pp) - 1:
        total += 3.0 * 2.0 * m.hidden_size * derived.padded_vocab_size(m, cfg.parallel.tp)
    return total * tokens


def _recomputed_share(cfg: RunConfig) -> float:
    """Share of layers whose forward runs twice (full recompute; block method: the first N per chunk)."""
    t = cfg.train
    if t.recompute != "full":
        return 0.0
    if t.recompute_method != "block":
        return 1.0
    chunks = [len(c) for stage in derived.pipeline_stage_layers(cfg) for c in stage if len(c)]
    return sum(min(n, max(1, t.recompute_num_layers)) for n in chunks) / max(1, sum(chunks))


def _bandwidth(cfg: RunConfig, kind: str, groups) -> float:
    c = cfg.cluster
    intra = groups[kind].intra_nvlink if kind in groups else True
    bw = c.intra_node_bw_gbps if intra else c.inter_node_bw_gbps
    return (bw if bw > 0 else NOMINAL_BW_GBPS) * 1e9


def estimate_step_time(cfg: RunConfig, groups=None) -> StepTime:
    """The model above for a validated layout (``groups``: a prebuilt group map, to save time)."""
    from megatron_recipes.topology.groups import build_group_map

    groups = groups if groups is not None else build_group_map(cfg)
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    nominal = c.peak_bf16_tflops <= 0
    peak = (NOMINAL_TFLOPS if nominal else c.peak_bf16_tflops) * 1e12
    pp, vpp = max(1, p.pp), derived.virtual_pipeline_size(cfg)
    act = _ACT_BYTES.get(cfg.precision.params_dtype, 2)
    micro = max(1, derived.num_microbatches(cfg))
    tokens_local = t.micro_batch_size * t.seq_length / p.cp  # per CP rank
    layers_per_stage = max(len(derived.layers_on_pipeline_rank(cfg, r)) for r in range(pp))
    moe_layers = max(sum(derived.is_moe_layer(m, i) for i in derived.layers_on_pipeline_rank(cfg, r)) for r in range(pp))

    compute = max(_stage_compute_flops(cfg, r) for r in range(pp)) / (p.tp * p.cp) / (peak * ASSUMED_MFU)
    activation = tokens_local * m.hidden_size * act
    tp = 0.0
    if p.tp > 1:
        ar = 2 * (p.tp - 1) / p.tp * activation
        tp = (4 + 2 * _recomputed_share(cfg)) * ar * layers_per_stage / _bandwidth(cfg, "tp", groups)
    cp = 0.0
    if p.cp > 1:
        groups_per_rank = (m.num_attention_heads if m.multi_latent_attention else m.num_query_groups) / p.tp
        kv = 2 * groups_per_rank * derived.head_dim(m) * tokens_local * act
        cp = 3 * (p.cp - 1) * kv * layers_per_stage / _bandwidth(cfg, "cp", groups)
    ep = 0.0
    if derived.is_moe(m) and p.ep > 1:
        routed = tokens_local / (p.tp if p.sp else 1) * m.moe_router_topk * m.hidden_size * act
        ep = 4 * (p.ep - 1) / p.ep * routed * moe_layers / _bandwidth(cfg, "ep", groups)
    pp_comm = 2 * vpp * activation / (p.tp if p.sp else 1) / _bandwidth(cfg, "pp", groups) if pp > 1 else 0.0
    per_micro = compute + tp + cp + ep + pp_comm
    dp = _dp_exposed(cfg, groups, per_micro)
    return StepTime(
        compute=micro * compute,
        bubble=schedule.bubble_slots(cfg) * per_micro,
        tp=micro * tp,
        cp=micro * cp,
        ep=micro * ep,
        pp=micro * pp_comm,
        dp=dp,
        tokens_per_step=t.global_batch_size * t.seq_length,
        world=derived.world_size(cfg),
        model_flops_per_token=model_flops_per_token(cfg),
        peak_flops=peak,
        nominal=nominal,
    )


def _dp_exposed(cfg: RunConfig, groups, per_micro: float) -> float:
    """Gradient reduce + parameter gather time per step not hidden behind compute."""
    prec, p = cfg.precision, cfg.parallel
    params = max((stage_params(cfg, r) for r in range(max(1, p.pp))), key=lambda c: c.total)
    grad = 4 if (prec.grad_reduce_in_fp32 or prec.params_dtype == "fp32") else 2
    weight = _ACT_BYTES.get(prec.params_dtype, 2)
    # distributed optimizer: reduce-scatter grads + all-gather params; plain DDP: all-reduce grads
    per_param = (grad + weight) if cfg.optimizer.use_distributed_optimizer else 2 * grad

    def volume(n_params: float, size: int) -> float:
        return n_params * per_param * (size - 1) / size if size > 1 else 0.0

    dense = volume(params.dense, derived.data_parallel_size(cfg) * p.cp) / _bandwidth(cfg, "dp_cp", groups)
    expert = volume(params.expert, derived.expert_data_parallel_size(cfg)) / _bandwidth(cfg, "edp", groups)
    total = dense + expert
    return max(0.0, total - per_micro) if p.overlap_grad_reduce else total
