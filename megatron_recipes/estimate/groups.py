"""Rank -> parallel group map, computed by megatron-core's own ``RankGenerator``.

Using megatron-core's generator (the one ``initialize_model_parallel`` uses, order ``tp-cp-ep-dp-pp``)
means the planner shows exactly the groups a run will build, with no process group and no GPU.
Each group kind is then marked by whether every one of its groups stays inside a node and inside an
NVLink domain, because that decides which links its collectives travel over.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Tuple

from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default rank order

# kind -> (which generator, token, what it carries)
GROUP_KINDS: Dict[str, Tuple[str, str, str]] = {
    "tp": ("dense", "tp", "tensor parallel: activations all-gather/reduce-scatter every layer"),
    "cp": ("dense", "cp", "context parallel: K/V exchange every attention layer"),
    "dp": ("dense", "dp", "data parallel replicas"),
    "dp_cp": ("dense", "dp-cp", "gradient reduce + distributed-optimizer shards (dense params)"),
    "pp": ("dense", "pp", "pipeline stages: point-to-point activations"),
    "ep": ("expert", "ep", "expert parallel: token all-to-all every MoE layer"),
    "etp": ("expert", "tp", "expert tensor parallel"),
    "edp": ("expert", "dp", "expert data parallel: expert gradient reduce + optimizer shards"),
}


@dataclass(frozen=True)
class GroupKind:
    name: str
    description: str
    groups: Tuple[Tuple[int, ...], ...]
    gpus_per_node: int
    nvlink_domain: int

    @property
    def size(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    def _spans(self, block: int) -> List[int]:
        return [len({r // block for r in g}) for g in self.groups]

    @property
    def intra_node(self) -> bool:
        return all(n == 1 for n in self._spans(self.gpus_per_node))

    @property
    def intra_nvlink(self) -> bool:
        return all(n == 1 for n in self._spans(self.nvlink_domain))

    @property
    def max_nodes_spanned(self) -> int:
        return max(self._spans(self.gpus_per_node), default=0)

    def groups_leaving_domain(self) -> List[Tuple[int, ...]]:
        return [g for g, n in zip(self.groups, self._spans(self.nvlink_domain)) if n > 1]


@lru_cache(maxsize=1)
def _rank_generator_class():
    with warnings.catch_warnings():  # megatron-core warns about absent TE/apex on import
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator
    return RankGenerator


@lru_cache(maxsize=256)
def _groups(tp: int, cp: int, ep: int, dp: int, pp: int, token: str) -> Tuple[Tuple[int, ...], ...]:
    gen = _rank_generator_class()(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=ORDER)
    return tuple(tuple(g) for g in gen.get_ranks(token))


def layout_is_factorised(cfg: RunConfig) -> bool:
    """True when both megatron-core generators (dense and expert) can be built for this world."""
    p = cfg.parallel
    degrees = [p.tp, p.pp, p.cp, p.ep, derived.expert_tensor_parallel_size(cfg)]
    return (
        all(d >= 1 for d in degrees)
        and derived.data_parallel_size(cfg) > 0
        and derived.expert_data_parallel_size(cfg) > 0
    )


def build_group_map(cfg: RunConfig) -> Dict[str, GroupKind]:
    """Every group kind of the layout; expert kinds only for MoE models."""
    if not layout_is_factorised(cfg):
        raise RecipeError(
            f"world size {derived.world_size(cfg)} does not factorise into this layout",
            fix="run `megatron-recipes plan` to see which validation rule fails",
        )
    p, c = cfg.parallel, cfg.cluster
    dp, edp = derived.data_parallel_size(cfg), derived.expert_data_parallel_size(cfg)
    etp = derived.expert_tensor_parallel_size(cfg)
    out: Dict[str, GroupKind] = {}
    for name, (which, token, description) in GROUP_KINDS.items():
        if which == "expert" and not derived.is_moe(cfg.model):
            continue
        if which == "dense":
            groups = _groups(p.tp, p.cp, 1, dp, p.pp, token)
        else:
            groups = _groups(etp, 1, p.ep, edp, p.pp, token)
        out[name] = GroupKind(name, description, groups, c.gpus_per_node, max(1, c.nvlink_domain))
    return out


def coordinates(groups: Dict[str, GroupKind]) -> Dict[str, Dict[int, int]]:
    """kind -> rank -> that rank's index inside its group of that kind (its tp rank, pp rank, ...)."""
    out: Dict[str, Dict[int, int]] = {}
    for name, kind in groups.items():
        out[name] = {r: i for g in kind.groups for i, r in enumerate(g)}
    return out
