"""Rules on context parallelism: sequence split, the communication type and what each one needs.

megatron-core's ``cp_comm_type`` values, as Transformer Engine runs them:
- ``p2p``: ring exchange of K/V chunks between neighbouring CP ranks (overlaps with compute);
- ``all_gather``: every rank all-gathers K/V (the only scheme of the local spec's CP attention);
- ``a2a``: all-to-all that scatters heads over CP (Ulysses), so heads must divide by cp;
- ``a2a+p2p``: a2a inside the first level of ``parallel.cp_hierarchical_sizes``, p2p across the rest.
  megatron-core builds those groups only when the sizes are given; without them TE gets no CP group.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules_base import choices, divisors, is_gpu, one_of, rule

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@rule(
    "cp.sequence_divisible",
    ["train.seq_length", "parallel.cp"],
    "with CP, seq_length is divisible by 2 * cp (load-balanced causal chunks)",
    "choose train.seq_length as a multiple of 2 * parallel.cp",
)
def _cp_seq(cfg: RunConfig) -> Optional[str]:
    p, s = cfg.parallel, cfg.train.seq_length
    if p.cp < 2 or s % (2 * p.cp) == 0:
        return None
    ok = [c for c in divisors(s) if c > 1 and s % (2 * c) == 0][:8]
    return f"train.seq_length={s} is not divisible by 2*parallel.cp = {2 * p.cp}; use parallel.cp in {choices([1] + ok)}"


@rule(
    "cp.comm_type",
    ["parallel.cp_comm_type"],
    "parallel.cp_comm_type is one of megatron-core's CP communication types",
    f"use one of {', '.join(CP_COMM_TYPES)}",
)
def _cp_comm(cfg: RunConfig) -> Optional[str]:
    return one_of(cfg.parallel.cp_comm_type, CP_COMM_TYPES, "parallel.cp_comm_type")


def _a2a_degree(cfg: RunConfig) -> Optional[int]:
    """How many CP ranks the all-to-all spans: cp for a2a, the first hierarchical level for a2a+p2p."""
    p = cfg.parallel
    if p.cp_comm_type == "a2a":
        return p.cp
    if p.cp_comm_type == "a2a+p2p" and p.cp_hierarchical_sizes:
        return p.cp_hierarchical_sizes[0]
    return None


@rule(
    "cp.a2a_heads",
    ["parallel.cp_comm_type", "parallel.cp", "parallel.cp_hierarchical_sizes", "parallel.tp", "model.num_attention_heads", "model.num_query_groups"],
    "all-to-all CP scatters heads, so heads (and query groups) per TP rank are divisible by the a2a degree "
    "(cp for a2a, cp_hierarchical_sizes[0] for a2a+p2p)",
    "use cp_comm_type=p2p, or an a2a degree dividing the heads per TP rank",
)
def _cp_a2a(cfg: RunConfig) -> Optional[str]:
    p, m = cfg.parallel, cfg.model
    degree = _a2a_degree(cfg)
    if p.cp < 2 or not degree or degree < 1 or p.tp < 1 or m.num_attention_heads % p.tp:
        return None
    heads = m.num_attention_heads // p.tp
    groups = heads if m.multi_latent_attention else m.num_query_groups // max(1, p.tp)
    if heads % degree == 0 and groups % degree == 0:
        return None
    what = "parallel.cp" if p.cp_comm_type == "a2a" else "parallel.cp_hierarchical_sizes[0]"
    return (
        f"parallel.cp_comm_type={p.cp_comm_type} with {what}={degree}: {heads} heads / {groups} query groups per "
        f"TP rank are not divisible by it; use {what} in {choices(sorted(set(divisors(heads)) & set(divisors(groups))))} or cp_comm_type=p2p"
    )


@rule(
    "cp.hierarchical_sizes",
    ["parallel.cp_comm_type", "parallel.cp", "parallel.cp_hierarchical_sizes"],
    "cp_comm_type=a2a+p2p needs parallel.cp_hierarchical_sizes (>= 2 levels, product = cp); other types take none",
    "e.g. parallel.cp=4 parallel.cp_comm_type=a2a+p2p 'parallel.cp_hierarchical_sizes=[2,2]' (a2a over the first level)",
)
def _cp_hierarchical(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    sizes = list(p.cp_hierarchical_sizes or [])
    if p.cp_comm_type != "a2a+p2p" or p.cp < 2:
        if sizes:
            return f"parallel.cp_hierarchical_sizes={sizes} is only used by cp_comm_type=a2a+p2p at cp>1 (here {p.cp_comm_type}, cp={p.cp}); remove it"
        return None
    if not sizes:
        return (
            f"parallel.cp_comm_type=a2a+p2p with parallel.cp={p.cp} but no parallel.cp_hierarchical_sizes: megatron-core "
            "would build no hierarchical CP groups and Transformer Engine would run attention without CP"
        )
    if len(sizes) < 2 or any(not isinstance(x, int) or x < 1 for x in sizes) or math.prod(sizes) != p.cp:
        return f"parallel.cp_hierarchical_sizes={sizes} must have >= 2 positive levels whose product is parallel.cp={p.cp}"
    return None


@rule(
    "cp.local_attention_all_gather",
    ["parallel.cp", "parallel.cp_comm_type", "cluster.gpu_arch"],
    "on a CPU cluster CP runs in the local spec's attention, which all-gathers K/V: cp_comm_type=all_gather",
    "set parallel.cp_comm_type=all_gather (or parallel.cp=1)",
)
def _cp_local(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.cp > 1 and not is_gpu(cfg) and p.cp_comm_type != "all_gather":
        return (
            f"parallel.cp={p.cp} with cp_comm_type={p.cp_comm_type} on cluster {cfg.cluster.name} (gpu_arch=cpu): "
            "without Transformer Engine the CP attention all-gathers keys/values; use parallel.cp_comm_type=all_gather"
        )
    return None


@rule(
    "cp.packing_te",
    ["data.kind", "data.packing", "parallel.cp", "cluster.gpu_arch"],
    "packed SFT data with CP on a GPU (Transformer Engine, THD format) is refused: TE needs each packed sample "
    "split into 2*cp chunks on its own, which the batch path does not do yet (the CPU lane's attention does honour packing)",
    "set data.packing=false, or parallel.cp=1",
)
def _cp_packing(cfg: RunConfig) -> Optional[str]:
    p, d = cfg.parallel, cfg.data
    if p.cp > 1 and d.kind == "sft" and d.packing and is_gpu(cfg):
        return f"data.packing=true with parallel.cp={p.cp} on GPU cluster {cfg.cluster.name}: packed THD batches are not split per sample for TE's CP"
    return None


CP_RULES = [_cp_seq, _cp_comm, _cp_a2a, _cp_hierarchical, _cp_local, _cp_packing]
