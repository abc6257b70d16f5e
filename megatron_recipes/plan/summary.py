"""The plan of a validated recipe as plain data: layout, group map, memory, step time.

One dict feeds both the terminal tables (``report``) and ``plan --json``, so they never disagree.
"""

from __future__ import annotations

from typing import Any, Dict, List

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate import rates
from megatron_recipes.estimate.groups import GroupKind, build_group_map, coordinates
from megatron_recipes.estimate.memory import GB, estimate_memory
from megatron_recipes.estimate.params import active_params, model_params
from megatron_recipes.estimate.sharding import host_memory, shard_groups
from megatron_recipes.estimate.steptime import estimate_step_time

SHOWN_GROUPS = 3  # groups listed per kind unless --all-groups
SHOWN_RANKS = 16  # ranks in the per-rank map unless --all-groups


def layout_dict(cfg: RunConfig) -> Dict[str, Any]:
    p, t = cfg.parallel, cfg.train
    stages = derived.pipeline_stage_layers(cfg)
    return {
        "world_size": derived.world_size(cfg),
        "nodes": cfg.cluster.nodes,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "tp": p.tp,
        "pp": p.pp,
        "vpp": p.vpp,
        "cp": p.cp,
        "dp": derived.data_parallel_size(cfg),
        "sp": p.sp,
        "ep": p.ep,
        "etp": derived.expert_tensor_parallel_size(cfg),
        "expert_dp": derived.expert_data_parallel_size(cfg),
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "num_microbatches": derived.num_microbatches(cfg),
        "seq_length": t.seq_length,
        "recompute": t.recompute,
        "recompute_modules": list(t.recompute_modules) if t.recompute == "selective" else [],
        "layers_per_stage": [[len(c) for c in chunks] for chunks in stages],
    }


def group_dict(kind: GroupKind, all_groups: bool) -> Dict[str, Any]:
    groups = [list(g) for g in kind.groups]
    return {
        "size": kind.size,
        "count": len(groups),
        "intra_node": kind.intra_node,
        "intra_nvlink_domain": kind.intra_nvlink,
        "max_nodes_spanned": kind.max_nodes_spanned,
        "description": kind.description,
        "groups": groups if all_groups else groups[:SHOWN_GROUPS],
    }


def rank_map(cfg: RunConfig, groups: Dict[str, GroupKind], all_ranks: bool) -> List[Dict[str, int]]:
    """Per rank: its node and its index inside each group kind (megatron-core's coordinates)."""
    world = derived.world_size(cfg)
    ranks = range(world) if all_ranks else range(min(world, SHOWN_RANKS))
    coords = coordinates(groups)
    return [{"rank": r, "node": r // cfg.cluster.gpus_per_node, **{k: coords[k][r] for k in groups}} for r in ranks]


def sharding_dict(cfg: RunConfig) -> Dict[str, Any]:
    p, o = cfg.parallel, cfg.optimizer
    groups = shard_groups(cfg)
    return {
        "stage": p.sharding if o.use_distributed_optimizer else "none",
        "fsdp": p.fsdp,
        "instances": p.dist_optimizer_instances,
        "dense_shard_ranks": groups.dense if o.use_distributed_optimizer else 1,
        "expert_shard_ranks": groups.expert if o.use_distributed_optimizer else 1,
        "optimizer_offload_fraction": o.offload_fraction if o.cpu_offload else 0.0,
        "activation_offload_layers": cfg.train.activation_offload_layers,
    }


def memory_dict(cfg: RunConfig) -> Dict[str, Any]:
    est = estimate_memory(cfg)
    host = host_memory(cfg)
    stages = []
    for s in est.stages:
        stages.append(
            {
                "pp_rank": s.pp_rank,
                "params": s.params.total,
                "expert_params": s.params.expert,
                "weights_gb": s.weights / GB,
                "grads_gb": s.grads / GB,
                "optimizer_gb": s.optimizer / GB,
                "activations_gb": s.activations / GB,
                "activations_per_microbatch_gb": s.per_microbatch / GB,
                "microbatches_in_flight": s.in_flight,
                "recompute_transient_gb": s.transient / GB,
                "overhead_gb": s.overhead / GB,
                "total_gb": s.total / GB,
            }
        )
    return {
        "capacity_gb": est.capacity / GB,
        "worst_stage": est.worst.pp_rank,
        "worst_total_gb": est.worst.total / GB,
        "margin_gb": est.margin / GB,
        "fits": est.fits,
        "bubble_fraction": est.bubble_fraction,
        "sharding": sharding_dict(cfg),
        "host_offload_per_node_gb": host.per_node / GB,
        "host_capacity_gb": host.capacity / GB,
        "host_fits": host.fits,
        "stages": stages,
    }


def time_dict(cfg: RunConfig, groups: Dict[str, GroupKind]) -> Dict[str, Any]:
    st = estimate_step_time(cfg, groups)
    return {
        "nominal_rates": st.nominal,
        "step_s": st.total,
        "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu,
        "spread": st.spread,
        "model_mfu": st.mfu,
        "breakdown_s": st.breakdown(),
        # EP all-to-all per step: as blocking exchanges; overlapped, the transfers' time on the links and the part
        # of it hidden behind the other micro-batch's computation (what stays exposed: breakdown_s["ep"])
        "ep_blocking_s": st.ep_blocking,
        "ep_transfer_s": st.ep_transfer,
        "ep_hidden_s": st.ep_hidden,
        "ep_overlap": cfg.parallel.overlap_moe_expert_parallel_comm,
        "dominant": st.dominant(),
        "assumptions": st.assumptions,
        "gemm_format": rates.gemm_format(cfg),
        "gemm_efficiency": rates.GEMM_EFFICIENCY[rates.gemm_format(cfg)],
    }


def checkpoint_dict(cfg: RunConfig) -> Dict[str, Any]:
    """What every save costs the host: the optimizer format a save will use and its fully_reshardable gather."""
    from megatron_recipes.checkpoint import optimizer_format_for
    from megatron_recipes.estimate.checkpoint_cost import optimizer_gather

    fmt, why = optimizer_format_for(cfg)
    cost = optimizer_gather(cfg)
    return {"optimizer_format": fmt, "why": why, "gather_host_gb": cost.host_bytes / GB,
            "gather_s": cost.seconds, "gather_large": cost.large}


def build_plan(cfg: RunConfig, recipe: str, all_groups: bool = False) -> Dict[str, Any]:
    groups = build_group_map(cfg)
    total = model_params(cfg)
    return {
        "recipe": recipe,
        "model": {"name": cfg.model.name, "params": total.total, "active_params": active_params(cfg)},
        "cluster": {
            "name": cfg.cluster.name,
            "gpu_arch": cfg.cluster.gpu_arch,
            "gpu_memory_gb": cfg.cluster.gpu_memory_gb,
            "nvlink_domain": cfg.cluster.nvlink_domain,
        },
        "layout": layout_dict(cfg),
        "order": "tp-cp-ep-dp-pp",
        "groups": {k: group_dict(v, all_groups) for k, v in groups.items()},
        "ranks": rank_map(cfg, groups, all_groups),
        "memory": memory_dict(cfg),
        "checkpoint": checkpoint_dict(cfg),
        "step_time": time_dict(cfg, groups),
    }

