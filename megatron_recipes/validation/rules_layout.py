"""Rules on the parallel layout: world factorisation, TP/SP, pipeline split, NVLink (CP: rules_cp.py)."""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate.groups import build_group_map
from megatron_recipes.validation.rules_base import (
    MAX_WORLD,
    choices,
    degrees_ok,
    divisors,
    fmt_ranks,
    is_gpu,
    pipeline_split_problem,
    rule,
    valid_tp_values,
    world_ok,
)


def _world_desc(cfg: RunConfig) -> str:
    c = cfg.cluster
    return f"world size {derived.world_size(cfg)} (cluster.nodes={c.nodes} x cluster.gpus_per_node={c.gpus_per_node})"


@rule(
    "layout.degrees_positive",
    ["parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.etp", "parallel.vpp", "cluster.nodes", "cluster.gpus_per_node"],
    "every parallel degree and the cluster shape are positive integers",
    "set each degree to 1 or more (parallel.vpp=null disables interleaving)",
    model_layout=True,
)
def _degrees_positive(cfg: RunConfig) -> Optional[str]:
    if degrees_ok(cfg):
        return None
    p, c = cfg.parallel, cfg.cluster
    values = dict(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp)
    bad = [f"parallel.{k}={v}" for k, v in values.items() if v is not None and v < 1]
    bad += [f"cluster.{k}={v}" for k, v in (("nodes", c.nodes), ("gpus_per_node", c.gpus_per_node)) if v < 1]
    return f"{', '.join(bad)} must be >= 1"


@rule(
    "layout.world_bounded",
    ["cluster.nodes", "cluster.gpus_per_node"],
    f"the world size (cluster.nodes x cluster.gpus_per_node) is at most {MAX_WORLD:,} GPUs",
    "check cluster.nodes and cluster.gpus_per_node (the nodes of the job, the GPUs of one node)",
)
def _world_bounded(cfg: RunConfig) -> Optional[str]:
    if not degrees_ok(cfg) or derived.world_size(cfg) <= MAX_WORLD:
        return None
    return f"{_world_desc(cfg)} is more GPUs than any cluster holds ({MAX_WORLD:,} at most here)"


@rule(
    "layout.world_factorisation",
    ["parallel.tp", "parallel.pp", "parallel.cp", "cluster.nodes", "cluster.gpus_per_node"],
    "the world size is divisible by tp * pp * cp (DP = world / (tp * pp * cp))",
    "change parallel.tp/pp/cp or cluster.nodes so that tp * pp * cp divides the world size",
)
def _world_factorisation(cfg: RunConfig) -> Optional[str]:
    if not degrees_ok(cfg) or derived.data_parallel_size(cfg) > 0:
        return None
    p, world = cfg.parallel, derived.world_size(cfg)
    mp = p.tp * p.pp * p.cp
    msg = f"{_world_desc(cfg)} is not divisible by parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {mp}"
    if world % (p.tp * p.cp) == 0:
        msg += f"; with tp={p.tp}, cp={p.cp} use parallel.pp in {choices(divisors(world // (p.tp * p.cp)))}"
    else:
        msg += f"; tp*pp*cp must be one of {choices(divisors(world))}"
    return msg


@rule(
    "layout.expert_factorisation",
    ["parallel.ep", "parallel.etp", "parallel.pp", "parallel.tp", "parallel.cp"],
    "etp * ep * pp divides the world, i.e. the expert layout fits in the DP x CP x TP ranks of each stage",
    "lower parallel.ep (or parallel.etp) so that etp * ep divides tp * cp * dp",
    model_layout=True,
)
def _expert_factorisation(cfg: RunConfig) -> Optional[str]:
    if not degrees_ok(cfg) or derived.data_parallel_size(cfg) == 0 or derived.expert_data_parallel_size(cfg) > 0:
        return None
    p = cfg.parallel
    etp = derived.expert_tensor_parallel_size(cfg)
    per_stage = p.tp * p.cp * derived.data_parallel_size(cfg)
    ok_ep = [e for e in divisors(per_stage // etp if per_stage % etp == 0 else 0) if not cfg.model.num_moe_experts or cfg.model.num_moe_experts % e == 0]
    return (
        f"parallel.etp*ep = {etp}*{p.ep} = {etp * p.ep} does not divide the {per_stage} ranks of a pipeline stage "
        f"(tp*cp*dp = {p.tp}*{p.cp}*{derived.data_parallel_size(cfg)}); use parallel.ep in {choices(ok_ep)}"
    )


@rule(
    "tp.attention_heads",
    ["model.num_attention_heads", "parallel.tp"],
    "num_attention_heads is divisible by parallel.tp",
    "pick a TP degree that divides the number of heads",
    model_layout=True,
)
def _tp_heads(cfg: RunConfig) -> Optional[str]:
    m, tp = cfg.model, cfg.parallel.tp
    if tp < 1 or m.num_attention_heads % tp == 0:
        return None
    return f"num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={tp}; use parallel.tp in {choices(valid_tp_values(cfg))}"


@rule(
    "tp.query_groups",
    ["model.num_query_groups", "parallel.tp"],
    "num_query_groups (K/V heads) is divisible by parallel.tp",
    "pick a TP degree that divides the number of query groups",
    model_layout=True,
)
def _tp_query_groups(cfg: RunConfig) -> Optional[str]:
    m, tp = cfg.model, cfg.parallel.tp
    if m.multi_latent_attention or tp < 1 or m.num_query_groups % tp == 0:
        return None
    return f"num_query_groups={m.num_query_groups} is not divisible by parallel.tp={tp}; use parallel.tp in {choices(valid_tp_values(cfg))}"


@rule(
    "tp.ffn_hidden",
    ["model.ffn_hidden_size", "model.moe_shared_expert_intermediate_size", "parallel.tp"],
    "ffn_hidden_size (and the shared-expert size) is divisible by parallel.tp",
    "pick a TP degree that divides the MLP width",
    model_layout=True,
)
def _tp_ffn(cfg: RunConfig) -> Optional[str]:
    m, tp = cfg.model, cfg.parallel.tp
    if tp < 1:
        return None
    for name in ("ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        size = getattr(m, name)
        if size and size % tp:
            return f"{name}={size} is not divisible by parallel.tp={tp}; use parallel.tp in {choices(valid_tp_values(cfg))}"
    return None


@rule(
    "tp.nvlink_domain",
    ["parallel.tp", "cluster.nvlink_domain", "parallel.allow_inter_node_tp"],
    "every TP group stays inside one NVLink domain (TP communicates every layer)",
    "lower parallel.tp, or set parallel.allow_inter_node_tp=true if you really mean it",
)
def _tp_nvlink(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if not is_gpu(cfg) or p.allow_inter_node_tp or not degrees_ok(cfg) or p.tp == 1:
        return None
    domain, world = max(1, cfg.cluster.nvlink_domain), derived.world_size(cfg)
    if world_ok(cfg):  # the groups megatron-core will build
        leaving = [list(g) for g in build_group_map(cfg)["tp"].groups_leaving_domain()]
    else:  # TP groups are always blocks of tp consecutive ranks (tp is first in the rank order)
        leaving = [list(range(s, s + p.tp)) for s in range(0, max(world, p.tp), p.tp) if s // domain != (s + p.tp - 1) // domain]
    if not leaving:
        return None
    return (
        f"parallel.tp={p.tp} puts TP groups such as {fmt_ranks(leaving[0])} across NVLink domains of {domain} GPUs "
        f"(cluster {cfg.cluster.name}, cluster.nvlink_domain={cfg.cluster.nvlink_domain}); "
        f"use parallel.tp in {choices(valid_tp_values(cfg))}"
    )


@rule(
    "sp.needs_tp",
    ["parallel.sp", "parallel.tp"],
    "sequence parallelism splits activations over the TP group, so it needs parallel.tp > 1",
    "set parallel.sp=false, or parallel.tp>1",
)
def _sp_needs_tp(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    return f"parallel.sp=true with parallel.tp={p.tp}; SP needs tp > 1" if p.sp and p.tp == 1 else None


@rule(
    "sp.sequence_divisible",
    ["train.seq_length", "parallel.tp", "parallel.cp", "parallel.sp"],
    "with SP, the per-CP-rank sequence (seq_length / cp) is divisible by parallel.tp",
    "choose train.seq_length as a multiple of tp * cp (times 2 with CP)",
)
def _sp_seq(cfg: RunConfig) -> Optional[str]:
    p, s = cfg.parallel, cfg.train.seq_length
    if not p.sp or p.tp < 2 or p.cp < 1 or s % p.cp:
        return None
    local = s // p.cp
    if local % p.tp == 0:
        return None
    return f"train.seq_length={s} / parallel.cp={p.cp} = {local} tokens per CP rank is not divisible by parallel.tp={p.tp}"


@rule(
    "pp.layer_split",
    ["model.num_layers", "parallel.pp", "parallel.vpp", "parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage",
     "parallel.account_for_embedding_in_pipeline_split", "parallel.account_for_loss_in_pipeline_split"],
    "the layers split over pp x vpp as megatron-core requires (evenly, with the first/last-stage sizes, or with the "
    "embedding/loss counted as layers)",
    "choose pp (and vpp) dividing num_layers, set num_layers_in_first/last_pipeline_stage, or "
    "parallel.account_for_embedding/loss_in_pipeline_split=true",
    model_layout=True,
)
def _pp_layer_split(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.pipeline_layout:  # the layout places every layer itself (rule pp.pipeline_layout)
        return None
    return pipeline_split_problem(cfg) if degrees_ok(cfg) else None


@rule(
    "pp.pipeline_layout",
    ["parallel.pipeline_layout", "parallel.pp", "parallel.vpp", "model.num_layers", "model.mtp_num_layers",
     "parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage",
     "parallel.account_for_embedding_in_pipeline_split", "parallel.account_for_loss_in_pipeline_split"],
    "parallel.pipeline_layout places every stage as megatron-core requires: pp x vpp stages, none empty, the embedding "
    "first, the loss last, model.num_layers decoder layers and model.mtp_num_layers MTP layers after them; it "
    "replaces the other split settings",
    "write one stage per PP rank and virtual stage, e.g. parallel.pipeline_layout='Et|tt|tt|tL' for 6 layers on pp=4",
    model_layout=True,
)
def _pp_pipeline_layout(cfg: RunConfig) -> Optional[str]:
    from megatron_recipes.config import pipeline_layout

    p = cfg.parallel
    if not p.pipeline_layout or not degrees_ok(cfg):
        return None
    others = [name for name, on in (("num_layers_in_first_pipeline_stage", p.num_layers_in_first_pipeline_stage is not None),
                                    ("num_layers_in_last_pipeline_stage", p.num_layers_in_last_pipeline_stage is not None),
                                    ("account_for_embedding_in_pipeline_split", p.account_for_embedding_in_pipeline_split),
                                    ("account_for_loss_in_pipeline_split", p.account_for_loss_in_pipeline_split)) if on]
    found = [f"it cannot be combined with parallel.{', parallel.'.join(others)} (megatron-core takes one way of "
             "splitting)"] if others else []
    found += pipeline_layout.problems(p.pipeline_layout, p.pp, p.vpp, cfg.model.num_layers, cfg.model.mtp_num_layers)
    return f"parallel.pipeline_layout={p.pipeline_layout!r}: " + "; ".join(found) if found else None


@rule(
    "pp.vpp_value",
    ["parallel.vpp", "parallel.pp"],
    "interleaving (parallel.vpp) is null, or >= 2 with parallel.pp > 1",
    "set parallel.vpp=null, or parallel.pp>1 with parallel.vpp>=2",
    model_layout=True,
)
def _vpp_value(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.vpp is None or p.vpp < 1:
        return None
    if p.pp < 2:
        return f"parallel.vpp={p.vpp} needs parallel.pp > 1 (got pp={p.pp}); use parallel.vpp=null"
    if p.vpp < 2:
        return "parallel.vpp=1 is no interleaving; use parallel.vpp=null or a value >= 2"
    return None


@rule(
    "pp.interleaved_microbatches",
    ["parallel.vpp", "parallel.pp", "train.global_batch_size", "train.micro_batch_size"],
    "the interleaved schedule needs the number of microbatches to be a multiple of parallel.pp",
    "make global_batch_size / (micro_batch_size * dp) a multiple of pp",
)
def _interleaved_mb(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if not p.vpp or p.vpp < 2 or p.pp < 2 or not world_ok(cfg):
        return None
    m = derived.num_microbatches(cfg)
    if m == 0 or m % p.pp == 0:
        return None
    step = cfg.train.micro_batch_size * derived.data_parallel_size(cfg) * p.pp
    return (
        f"{m} microbatches per step is not a multiple of parallel.pp={p.pp} (interleaved schedule, vpp={p.vpp}); "
        f"use train.global_batch_size as a multiple of {step}"
    )


@rule(
    "pp.pipeline_fill",
    ["parallel.pp", "train.global_batch_size", "train.micro_batch_size"],
    "a pipeline runs at least pp microbatches per step, or most stages sit idle",
    "raise train.global_batch_size or lower train.micro_batch_size",
)
def _pipeline_fill(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.pp < 2 or not world_ok(cfg):
        return None
    m = derived.num_microbatches(cfg)
    if m == 0 or m >= p.pp:
        return None
    need = p.pp * cfg.train.micro_batch_size * derived.data_parallel_size(cfg)
    return f"{m} microbatches per step < parallel.pp={p.pp}; use train.global_batch_size >= {need}"


@rule(
    "cluster.nvlink_domain_shape",
    ["cluster.nvlink_domain", "cluster.gpus_per_node"],
    "an NVLink domain is made of whole nodes: nvlink_domain is a positive multiple of gpus_per_node",
    "set cluster.nvlink_domain to gpus_per_node (HGX) or the rack size (NVL72)",
)
def _nvlink_shape(cfg: RunConfig) -> Optional[str]:
    c = cfg.cluster
    if c.gpus_per_node < 1 or (c.nvlink_domain >= 1 and c.nvlink_domain % c.gpus_per_node == 0):
        return None
    return f"cluster.nvlink_domain={c.nvlink_domain} is not a positive multiple of cluster.gpus_per_node={c.gpus_per_node}"


LAYOUT_RULES = [
    _degrees_positive,
    _world_bounded,
    _world_factorisation,
    _expert_factorisation,
    _tp_heads,
    _tp_query_groups,
    _tp_ffn,
    _tp_nvlink,
    _sp_needs_tp,
    _sp_seq,
    _pp_layer_split,
    _pp_pipeline_layout,
    _vpp_value,
    _interleaved_mb,
    _pipeline_fill,
    _nvlink_shape,
]
