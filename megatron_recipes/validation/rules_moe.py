"""Rules on mixture-of-experts settings: EP/ETP degrees, routing, token dispatcher, EP placement."""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate.groups import build_group_map
from megatron_recipes.validation.rules_base import blocks_cross_domain, choices, divisors, fmt_ranks, is_gpu, one_of, rule, world_ok

DISPATCHERS = ("allgather", "alltoall", "flex")
FLEX_BACKENDS = ("deepep", "hybridep")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def _moe(cfg: RunConfig) -> bool:
    return derived.is_moe(cfg.model)


def _valid_ep(cfg: RunConfig) -> list[int]:
    """EP degrees that divide the experts and fit the ranks of a pipeline stage (with this ETP)."""
    p = cfg.parallel
    experts = cfg.model.num_moe_experts or 1
    per_stage = derived.world_size(cfg) // max(1, p.pp)
    etp = derived.expert_tensor_parallel_size(cfg)
    return [e for e in divisors(experts) if etp >= 1 and per_stage % (e * etp) == 0]


@rule(
    "moe.ep_needs_experts",
    ["parallel.ep", "model.num_moe_experts"],
    "expert parallelism (parallel.ep > 1) needs a mixture-of-experts model",
    "set parallel.ep=1 for a dense model",
    model_layout=True,
)
def _ep_needs_experts(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.ep > 1 and not _moe(cfg):
        return f"parallel.ep={cfg.parallel.ep} but model {cfg.model.name} has no experts (num_moe_experts unset); use parallel.ep=1"
    return None


@rule(
    "moe.settings_need_experts",
    ["model.moe_ffn_hidden_size", "model.moe_shared_expert_intermediate_size", "model.num_moe_experts"],
    "MoE-only sizes are unset on dense models (megatron-core rejects them)",
    "remove the MoE fields, or set model.num_moe_experts",
    model_layout=True,
)
def _settings_need_experts(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if _moe(cfg):
        return None
    set_ = [f"model.{n}={getattr(m, n)}" for n in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size") if getattr(m, n)]
    return f"{', '.join(set_)} set on a dense model (num_moe_experts unset)" if set_ else None


@rule(
    "moe.experts_divisible_by_ep",
    ["model.num_moe_experts", "parallel.ep"],
    "num_moe_experts is divisible by parallel.ep (each EP rank holds the same number of experts)",
    "pick parallel.ep dividing the number of experts",
    model_layout=True,
)
def _experts_ep(cfg: RunConfig) -> Optional[str]:
    m, ep = cfg.model, cfg.parallel.ep
    if not _moe(cfg) or ep < 1 or m.num_moe_experts % ep == 0:
        return None
    return f"num_moe_experts={m.num_moe_experts} is not divisible by parallel.ep={ep}; use parallel.ep in {choices(_valid_ep(cfg))}"


@rule(
    "moe.router_topk",
    ["model.moe_router_topk", "model.num_moe_experts", "model.moe_router_score_function", "model.moe_router_pre_softmax"],
    "1 <= moe_router_topk <= num_moe_experts; top-1 softmax routing needs moe_router_pre_softmax",
    "set a top-k between 1 and the number of experts",
    model_layout=True,
)
def _router_topk(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not _moe(cfg):
        return None
    if not 1 <= m.moe_router_topk <= m.num_moe_experts:
        return f"model.moe_router_topk={m.moe_router_topk} must be in [1, num_moe_experts={m.num_moe_experts}]"
    if m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax and m.moe_router_load_balancing_type != "sinkhorn":
        return "model.moe_router_topk=1 with softmax scores gives zero router gradients; set model.moe_router_pre_softmax=true"
    return None


@rule(
    "moe.group_routing",
    ["model.moe_router_num_groups", "model.moe_router_group_topk", "model.num_moe_experts", "model.moe_router_topk"],
    "group-limited routing: num_groups divides the experts, group_topk <= num_groups, topk fits the chosen groups",
    "set moe_router_num_groups/group_topk consistently (DeepSeek-V3: 8 groups, 4 chosen)",
    model_layout=True,
)
def _group_routing(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not _moe(cfg) or not (m.moe_router_group_topk or m.moe_router_num_groups):
        return None
    g, k = m.moe_router_num_groups, m.moe_router_group_topk
    if not g or not k:
        return f"model.moe_router_num_groups={g} and model.moe_router_group_topk={k} must both be set"
    if m.num_moe_experts % g:
        return f"num_moe_experts={m.num_moe_experts} is not divisible by moe_router_num_groups={g}; use one of {choices(divisors(m.num_moe_experts))}"
    if k > g:
        return f"model.moe_router_group_topk={k} > moe_router_num_groups={g}"
    if m.moe_router_topk > k * (m.num_moe_experts // g):
        return f"model.moe_router_topk={m.moe_router_topk} exceeds the {k * (m.num_moe_experts // g)} experts in {k} chosen groups"
    return None


@rule(
    "moe.router_options",
    ["model.moe_router_score_function", "model.moe_router_load_balancing_type", "model.moe_router_enable_expert_bias"],
    "score function and load balancing are known values; expert-bias (aux-loss-free) routing needs sigmoid scores",
    "use a listed value; moe_router_enable_expert_bias=true with moe_router_score_function=sigmoid",
    model_layout=True,
)
def _router_options(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not _moe(cfg):
        return None
    bad = one_of(m.moe_router_score_function, SCORE_FUNCTIONS, "model.moe_router_score_function") or one_of(
        m.moe_router_load_balancing_type, LOAD_BALANCING, "model.moe_router_load_balancing_type"
    )
    if bad:
        return bad
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        return "model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid"
    return None


@rule(
    "moe.global_aux_loss_layout",
    ["model.moe_router_load_balancing_type", "parallel.tp", "parallel.pp", "parallel.cp", "cluster.nodes",
     "cluster.gpus_per_node"],
    "global_aux_loss trains the same at every data-parallel size: megatron-core (0.16 to 0.19.2) divides its gradient "
    "by the data-parallel size (Megatron-LM #3672, unfixed), so a layout change would change the router's training",
    "use model.moe_router_load_balancing_type=aux_loss or seq_aux_loss, or run global_aux_loss at data-parallel size 1",
    model_layout=True,
)
def _global_aux_loss_layout(cfg: RunConfig) -> Optional[str]:
    if not _moe(cfg) or cfg.model.moe_router_load_balancing_type != "global_aux_loss" or not world_ok(cfg):
        return None
    dp = derived.data_parallel_size(cfg)
    if dp > 1:
        return (f"model.moe_router_load_balancing_type=global_aux_loss at data-parallel size {dp}: megatron-core scales "
                f"its load-balancing gradient down with the data-parallel size (Megatron-LM #3672), so this run would "
                f"balance the experts less than the same run at data-parallel size 1")
    return None


@rule(
    "moe.first_dense_layers",
    ["model.moe_first_dense_layers", "model.num_layers"],
    "0 <= moe_first_dense_layers < num_layers",
    "set how many leading layers stay dense (DeepSeek-V3: 3)",
    model_layout=True,
)
def _first_dense(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    if not _moe(cfg) or 0 <= m.moe_first_dense_layers < m.num_layers:
        return None
    return f"model.moe_first_dense_layers={m.moe_first_dense_layers} must be in [0, num_layers={m.num_layers})"


@rule(
    "moe.tp_needs_sp",
    ["parallel.sp", "parallel.tp", "model.num_moe_experts"],
    "MoE layers with TP > 1 need sequence parallelism (megatron-core refuses to train otherwise)",
    "set parallel.sp=true",
    model_layout=True,
)
def _tp_needs_sp(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if _moe(cfg) and p.tp > 1 and not p.sp:
        return f"MoE model with parallel.tp={p.tp} and parallel.sp=false; set parallel.sp=true"
    return None


@rule(
    "etp.expert_ffn",
    ["parallel.etp", "model.moe_ffn_hidden_size"],
    "the expert FFN width is divisible by the expert tensor-parallel degree",
    "pick parallel.etp dividing moe_ffn_hidden_size (etp=1 is usual for fine-grained experts)",
    model_layout=True,
)
def _etp_ffn(cfg: RunConfig) -> Optional[str]:
    m = cfg.model
    etp = derived.expert_tensor_parallel_size(cfg)
    if not _moe(cfg) or etp < 1:
        return None
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if ffn % etp == 0:
        return None
    return f"moe_ffn_hidden_size={ffn} is not divisible by expert TP {etp} (parallel.etp={cfg.parallel.etp}); use parallel.etp in {choices(divisors(ffn)[:8])}"


@rule(
    "etp.bias_needs_etp1",
    ["model.add_bias_linear", "parallel.etp", "model.num_moe_experts"],
    "MoE experts with biases need expert TP of 1",
    "set parallel.etp=1, or model.add_bias_linear=false",
)
def _bias_etp(cfg: RunConfig) -> Optional[str]:
    etp = derived.expert_tensor_parallel_size(cfg)
    if _moe(cfg) and cfg.model.add_bias_linear and etp != 1:
        return f"model.add_bias_linear=true with expert TP {etp}; megatron-core supports MoE biases only with etp=1"
    return None


@rule(
    "moe.dispatcher_values",
    ["parallel.moe_dispatcher", "parallel.moe_flex_backend"],
    "the token dispatcher is allgather, alltoall or flex; the flex backend is deepep or hybridep",
    f"use parallel.moe_dispatcher in {{{', '.join(DISPATCHERS)}}}",
)
def _dispatcher_values(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    return one_of(p.moe_dispatcher, DISPATCHERS, "parallel.moe_dispatcher") or one_of(
        p.moe_flex_backend, FLEX_BACKENDS, "parallel.moe_flex_backend"
    )


@rule(
    "moe.flex_needs_tp_ep",
    ["parallel.moe_dispatcher", "parallel.ep", "parallel.etp"],
    "the flex dispatcher exchanges tokens over the expert TP x EP group, so that group has > 1 rank",
    "use parallel.moe_dispatcher=alltoall, or parallel.ep>1",
)
def _flex_tp_ep(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    etp = derived.expert_tensor_parallel_size(cfg)
    if _moe(cfg) and p.moe_dispatcher == "flex" and etp * p.ep <= 1:
        return f"parallel.moe_dispatcher=flex with expert TP {etp} x parallel.ep={p.ep} = 1 rank"
    return None


@rule(
    "moe.flex_needs_gpu",
    ["parallel.moe_dispatcher", "cluster.gpu_arch"],
    "the flex dispatcher's DeepEP/HybridEP kernels are CUDA-only",
    "use parallel.moe_dispatcher=alltoall or allgather on a CPU cluster",
)
def _flex_gpu(cfg: RunConfig) -> Optional[str]:
    if _moe(cfg) and cfg.parallel.moe_dispatcher == "flex" and not is_gpu(cfg):
        return f"parallel.moe_dispatcher=flex ({cfg.parallel.moe_flex_backend}) on cluster {cfg.cluster.name} (gpu_arch=cpu)"
    return None


@rule(
    "moe.allgather_vs_ep",
    ["parallel.moe_dispatcher", "parallel.ep", "cluster.nvlink_domain"],
    "the allgather dispatcher copies every token to every EP rank: only inside one NVLink domain",
    "use parallel.moe_dispatcher=alltoall (or flex) when EP spans NVLink domains",
)
def _allgather_ep(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if not (_moe(cfg) and p.moe_dispatcher == "allgather" and p.ep > 1 and is_gpu(cfg) and world_ok(cfg)):
        return None
    span = derived.expert_tensor_parallel_size(cfg) * p.ep
    if not blocks_cross_domain(derived.world_size(cfg), span, cfg.cluster.nvlink_domain):
        return None
    return f"parallel.moe_dispatcher=allgather with EP groups of {span} ranks crossing NVLink domains of {cfg.cluster.nvlink_domain}"


@rule(
    "ep.nvlink_domain",
    ["parallel.ep", "parallel.etp", "cluster.nvlink_domain", "parallel.allow_inter_node_ep"],
    "every EP group stays inside one NVLink domain, unless parallel.allow_inter_node_ep=true",
    "lower parallel.ep, or set parallel.allow_inter_node_ep=true (large MoE models over InfiniBand)",
)
def _ep_nvlink(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if not _moe(cfg) or p.ep == 1 or not is_gpu(cfg) or p.allow_inter_node_ep or not world_ok(cfg):
        return None
    leaving = build_group_map(cfg)["ep"].groups_leaving_domain()
    if not leaving:
        return None
    domain = cfg.cluster.nvlink_domain
    etp = derived.expert_tensor_parallel_size(cfg)
    ok = [e for e in _valid_ep(cfg) if not blocks_cross_domain(derived.world_size(cfg), e * etp, domain)]
    return (
        f"parallel.ep={p.ep} (expert TP {etp}) puts EP groups such as {fmt_ranks(leaving[0])} across NVLink domains "
        f"of {domain} GPUs; use parallel.ep in {choices(ok)} or set parallel.allow_inter_node_ep=true"
    )


@rule(
    "etp.nvlink_domain",
    ["parallel.etp", "cluster.nvlink_domain", "parallel.allow_inter_node_tp"],
    "every expert-TP group stays inside one NVLink domain (it is a TP group), unless parallel.allow_inter_node_tp=true",
    "lower parallel.etp (etp=1 is usual for fine-grained experts)",
)
def _etp_nvlink(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    etp = derived.expert_tensor_parallel_size(cfg)
    if not _moe(cfg) or etp == 1 or etp == p.tp or not is_gpu(cfg) or p.allow_inter_node_tp or not world_ok(cfg):
        return None  # etp == tp: tp.nvlink_domain already judges these ranks
    leaving = build_group_map(cfg)["etp"].groups_leaving_domain()
    if not leaving:
        return None
    ok = [e for e in divisors(cfg.cluster.nvlink_domain) if e <= etp]
    return (
        f"parallel.etp={etp} puts expert-TP groups such as {fmt_ranks(leaving[0])} across NVLink domains of "
        f"{cfg.cluster.nvlink_domain} GPUs; use parallel.etp in {choices(ok)}"
    )


MOE_RULES = [
    _ep_needs_experts,
    _settings_need_experts,
    _experts_ep,
    _router_topk,
    _group_routing,
    _router_options,
    _global_aux_loss_layout,
    _first_dense,
    _tp_needs_sp,
    _etp_ffn,
    _bias_etp,
    _dispatcher_values,
    _flex_tp_ep,
    _flex_gpu,
    _allgather_ep,
    _ep_nvlink,
    _etp_nvlink,
]
