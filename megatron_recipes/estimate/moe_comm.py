"""Expert-parallel token traffic: the all-to-all of an MoE layer, blocking or hidden behind computation.

Volume: per MoE layer and microbatch, dispatch + combine forward and backward of ``k`` copies of each
local token, ``(ep - 1) / ep`` of them leaving the rank, over the slower link used. ``alltoall`` /
``allgather`` move every copy to its expert's rank; ``flex`` (DeepEP / HybridEP) crosses the network once
per remote NVLink domain holding one of a token's experts, then fans out over NVLink (expected distinct
remote domains ``(n - 1) (1 - (1 - 1/n)^k)``).

Two rates for that volume. A blocking exchange (``blocking_time``: every run without the overlap) costs
the volume at ``ALL_TO_ALL_EFFICIENCY`` of the link, the figure calibrated on a run that blocks: the
transfer and the time every rank waits for its slowest peer at each exchange. With
``parallel.overlap_moe_expert_parallel_comm`` the communication stream carries the transfer itself
(``transfer_time``, at ``LINK_EFFICIENCY`` like every collective here) while the other micro-batch's
computation fills the waiting.

The overlap is megatron-core's combined 1F1B schedule: one micro-batch's forward runs with another's
backward, layer by layer, on a computation and a communication stream (``TransformerLayerSchedulePlan.run``)::

    communication:  combine bwd | dispatch fwd -> dispatch bwd            | combine fwd
    computation:    attn fwd    | mlp bwd -> mlp weight grads -> mlp fwd  | attn bwd

Each transfer waits for the computation that produces its input and each computation for the transfer
that feeds it; ``combined_layer_time`` plays that order. What can hide: the forward's transfers behind
the backward's computation and the other way round, never more than the pair's computation; whatever
exceeds it stays exposed (a comm-bound layer takes its four transfers' time). With
``delay_wgrad_compute`` the experts' weight gradients run after ``dispatch bwd`` has started, filling
it; without, ``dispatch bwd`` waits for the whole MLP backward. Micro-batches outside the steady state
(warm-up forwards, cool-down backwards, megatron-core's ``get_pp_rank_microbatches`` plus the extra
forward the overlap schedules) run alone: their exchanges block.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate import rates


@dataclass(frozen=True)
class LayerSides:
    """Seconds of one micro-batch's forward through one layer on one GPU, by the nodes the combined
    schedule runs: the attention side (norm, QKV, core attention, projection, router, TP collectives) and
    the MLP side (experts, shared experts). Backward takes ``2 x`` of each: input gradients, then weight
    gradients (for the MLP side ``mlp_dgrad`` and ``mlp_wgrad``)."""

    attn: float
    mlp: float

    @property
    def attn_bwd(self) -> float:
        return 2 * self.attn

    @property
    def mlp_dgrad(self) -> float:
        return self.mlp

    @property
    def mlp_wgrad(self) -> float:
        return self.mlp

    @property
    def pair(self) -> float:
        """Computation of one forward plus one backward of the layer."""
        return 3 * (self.attn + self.mlp)


def off_domain_share(cfg: RunConfig, groups) -> float:
    """Share of a rank's EP peers outside its NVLink domain."""
    if "ep" not in groups or groups["ep"].size < 2:
        return 0.0
    g, dom = groups["ep"].groups[0], max(1, cfg.cluster.nvlink_domain)
    return sum(r // dom != g[0] // dom for r in g) / (len(g) - 1)


def _link_seconds(cfg: RunConfig, groups, tokens_local: float, act: int) -> float:
    """One MoE layer's four exchanges (dispatch + combine, forward + backward) of one micro-batch at the
    links' full datasheet bandwidth."""
    m, p, c = cfg.model, cfg.parallel, cfg.cluster
    k = m.moe_router_topk
    token = tokens_local / (p.tp if p.sp else 1) * m.hidden_size * act
    off = off_domain_share(cfg, groups)
    domains = max(1, round(1 / (1 - off * (p.ep - 1) / p.ep))) if off < 1 else p.ep
    if p.moe_dispatcher == "flex" and domains > 1:
        inter = (domains - 1) * (1 - (1 - 1 / domains) ** k) * token
    else:
        inter = k * (p.ep - 1) / p.ep * off * token
    intra = k * (p.ep - 1) / p.ep * (1 - off) * token
    nvl = (c.intra_node_bw_gbps or rates.NOMINAL_BW_GBPS) * 1e9
    net = (c.inter_node_bw_gbps or rates.NOMINAL_BW_GBPS) * 1e9
    return 4 * max(intra / nvl, inter / net)


def blocking_time(cfg: RunConfig, groups, tokens_local: float, act: int) -> float:
    """Seconds of one MoE layer's four exchanges of one micro-batch, each blocking (module docstring)."""
    return _link_seconds(cfg, groups, tokens_local, act) / rates.ALL_TO_ALL_EFFICIENCY


def transfer_time(cfg: RunConfig, groups, tokens_local: float, act: int) -> float:
    """The same four exchanges on the overlapped schedule's communication stream: the transfers alone."""
    return _link_seconds(cfg, groups, tokens_local, act) / rates.LINK_EFFICIENCY


def combined_layer_time(sides: LayerSides, transfer: float, delay_wgrad: bool) -> float:
    """Seconds for one layer's forward of one micro-batch with its backward of another, each of the four
    transfers taking ``transfer`` seconds, in megatron-core's stream order (module docstring)."""
    attn_fwd_end = sides.attn
    combine_bwd_end = transfer
    dgrad_end = max(attn_fwd_end, combine_bwd_end) + sides.mlp_dgrad
    wgrad_end = dgrad_end + sides.mlp_wgrad
    dispatch_fwd_end = max(combine_bwd_end, attn_fwd_end) + transfer
    dispatch_bwd_end = max(dispatch_fwd_end, dgrad_end if delay_wgrad else wgrad_end) + transfer
    mlp_fwd_end = max(wgrad_end, dispatch_fwd_end) + sides.mlp
    combine_fwd_end = max(dispatch_bwd_end, mlp_fwd_end) + transfer
    attn_bwd_end = max(mlp_fwd_end, dispatch_bwd_end) + sides.attn_bwd
    return max(combine_fwd_end, attn_bwd_end)


def unpaired_share(cfg: RunConfig, pp_rank: int = 0) -> float:
    """Share of a stage's chunk-microbatches whose forward (or backward) runs alone under the combined
    schedule: the warm-up forwards (and as many cool-down backwards) of ``pp_rank``; without pipelining,
    the first forward and the last backward."""
    pp, vpp = max(1, cfg.parallel.pp), derived.virtual_pipeline_size(cfg)
    total = max(1, derived.num_microbatches(cfg)) * vpp
    if pp == 1:
        return min(1.0, 1 / total)
    warmup = 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1  # interleaved (megatron-core requires vpp here)
    return min(1.0, warmup / total)


def exposed_time(cfg: RunConfig, sides: LayerSides, blocking: float, transfer: float, moe_layers: int,
                 pp_rank: int = 0) -> tuple[float, float]:
    """(exposed, hidden): seconds of EP exchanges per micro-batch that computation does not hide, and the
    overlapped transfers' seconds it does (``blocking``, ``transfer``: one layer's four exchanges as
    ``blocking_time`` and ``transfer_time`` give them)."""
    if not cfg.parallel.overlap_moe_expert_parallel_comm:
        return moe_layers * blocking, 0.0
    paired = max(0.0, combined_layer_time(sides, transfer / 4, cfg.parallel.delay_wgrad_compute) - sides.pair)
    alone = unpaired_share(cfg, pp_rank)
    return moe_layers * ((1 - alone) * paired + alone * blocking), moe_layers * (1 - alone) * (transfer - paired)
