"""Layout search: enumerate (tp, pp, vpp, cp, ep, etp, sp, micro batch, recompute) for a recipe's model
and cluster, rank by the analytic step time, and keep only layouts that pass every validation rule.

Cheap arithmetic screens the space first; candidates are then ranked by estimated step time and the
full rule table (memory included) is run down that ranking until enough valid layouts are found, so
every layout this returns passes ``validate()``. Each (tp, pp, cp, ep, etp) appears once, with its
fastest vpp / micro batch / recompute: the estimates of those variants differ by less than the model
can resolve, and five variants of one layout would hide the alternatives.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.estimate import sharding
from megatron_recipes.estimate.groups import build_group_map
from megatron_recipes.estimate.memory import MemoryEstimate, estimate_memory
from megatron_recipes.estimate.steptime import StepTime, estimate_step_time
from megatron_recipes.validation.rules import select
from megatron_recipes.validation.rules_base import divisors, pipeline_split_problem
from megatron_recipes.validation.validate import validate

# Planning judges the recipe scope only; the input rules (files a training job reads, which planning never
# opens) are left to `train`, and `plan` names them.
PLAN_RULES = select(("recipe",))
INPUT_RULES = tuple(r.id for r in select(("input",)))
MICRO_BATCHES = (1, 2, 4)
MAX_VPP = 8


@dataclass(frozen=True)
class Candidate:
    cfg: RunConfig
    time: StepTime
    memory: MemoryEstimate
    sharding_mode: Optional[str] = None  # set when the search had to change the recipe's sharding

    def overrides(self) -> List[str]:
        """Hydra overrides that turn the recipe into this layout."""
        p, t = self.cfg.parallel, self.cfg.train
        out = [f"parallel.tp={p.tp}", f"parallel.pp={p.pp}", f"parallel.vpp={_null(p.vpp)}", f"parallel.cp={p.cp}"]
        if derived.is_moe(self.cfg.model):
            out += [f"parallel.ep={p.ep}", f"parallel.etp={_null(p.etp)}"]
        out.append(f"parallel.sp={str(p.sp).lower()}")
        out += [
            f"parallel.num_layers_in_first_pipeline_stage={_null(p.num_layers_in_first_pipeline_stage)}",
            f"parallel.num_layers_in_last_pipeline_stage={_null(p.num_layers_in_last_pipeline_stage)}",
        ]
        out.append("parallel.pipeline_layout=null")
        counted = str(p.account_for_embedding_in_pipeline_split).lower()
        out += [f"parallel.account_for_embedding_in_pipeline_split={counted}",
                f"parallel.account_for_loss_in_pipeline_split={counted}"]
        out += [f"train.micro_batch_size={t.micro_batch_size}", f"train.recompute={t.recompute}",
                f"train.recompute_modules=[{','.join(t.recompute_modules)}]"]
        if self.sharding_mode is not None:
            out += sharding.overrides(self.cfg)
        return out

    def command_overrides(self, user: Sequence[str] = ()) -> List[str]:
        """The user's own overrides (minus keys this layout sets: Hydra rejects a key given twice) + the layout's."""
        layout = self.overrides()
        keys = {o.split("=", 1)[0] for o in layout}
        return [o for o in user if o.split("=", 1)[0].lstrip("+~") not in keys] + layout


@dataclass
class SearchResult:
    best: List[Candidate]
    screened: int  # layouts that passed the arithmetic screen
    enumerated: int
    rejected: Counter  # rule id -> how many ranked candidates it rejected


def _null(value: Optional[int]) -> str:
    return "null" if value is None else str(value)


def _pipeline_splits(layers: int, pp: int) -> Iterator[Tuple[Optional[int], Optional[int], bool]]:
    """(first, last, counted): an even split; the embedding and loss counted as layers (e.g. 126 + 2 over
    8 x 8); or first/last-stage sizes that make an uneven one work (e.g. 61 layers)."""
    if pp == 1 or layers % pp == 0:
        yield None, None, False
        return
    if (layers + 2) % pp == 0:
        yield None, None, True
    if pp == 2:
        yield (layers + 1) // 2, None, False
        return
    for per_middle in {layers // pp, -(-layers // pp)}:
        rest = layers - (pp - 2) * per_middle
        if rest >= 2:
            yield rest - rest // 2, rest // 2, False


def _vpp_options(cfg: RunConfig, pp: int, first: Optional[int], counted: bool = False) -> List[Optional[int]]:
    if pp == 1 or first is not None:
        return [None]
    per_stage = (cfg.model.num_layers + (2 if counted else 0)) // pp
    return [None] + [v for v in divisors(per_stage) if 2 <= v <= MAX_VPP]


def enumerate_layouts(cfg: RunConfig) -> Iterator[RunConfig]:
    """Every combination of the searched knobs whose degrees factorise the world."""
    m, c = cfg.model, cfg.cluster
    world = derived.world_size(cfg)
    gpu = c.gpu_arch != "cpu"
    tps = [t for t in divisors(m.num_attention_heads) if world % t == 0 and t <= max(1, c.nvlink_domain)]
    cps = [x for x in (1, 2, 4, 8, 16) if world % x == 0 and (x == 1 or gpu)]
    experts = m.num_moe_experts or 1
    # selective: core attention on CPU clusters (GPUs' flash attention keeps little), and the recipe's own modules
    recomputes = ["none", "full"] + (["selective"] if not gpu or cfg.train.recompute == "selective" else [])
    for tp in tps:
        etps = [1, tp] if derived.is_moe(m) and tp > 1 else [None]
        for cp in cps:
            for pp in divisors(world // (tp * cp)):
                if pp > m.num_layers:
                    continue
                for first, last, counted in _pipeline_splits(m.num_layers, pp):
                    for vpp in _vpp_options(cfg, pp, first, counted):
                        for etp in etps:
                            e_tp = etp or tp
                            per_stage = world // pp
                            eps = [e for e in divisors(experts) if per_stage % (e * e_tp) == 0]
                            for ep in eps:
                                for mbs in MICRO_BATCHES:
                                    for rc in recomputes:
                                        yield _with(cfg, tp, pp, vpp, cp, ep, etp, (first, last, counted), mbs, rc)


def _with(cfg, tp, pp, vpp, cp, ep, etp, split, mbs, recompute) -> RunConfig:
    first, last, counted = split
    parallel = dataclasses.replace(
        cfg.parallel, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sp=tp > 1,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=counted, account_for_loss_in_pipeline_split=counted,
        pipeline_layout=None,  # the search places layers by the split fields; a layout is written by hand
    )
    modules = list(cfg.train.recompute_modules) if recompute == "selective" else ["core_attn"]
    train = dataclasses.replace(cfg.train, micro_batch_size=mbs, recompute=recompute, recompute_num_layers=1, recompute_method="uniform",
                                recompute_modules=modules)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


def _screen(cfg: RunConfig) -> bool:
    """Arithmetic a layout needs before estimates mean anything (the rule table decides later)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.num_attention_heads % p.tp or (not m.multi_latent_attention and m.num_query_groups % p.tp):
        return False
    if m.ffn_hidden_size % p.tp or (p.cp > 1 and t.seq_length % (2 * p.cp)) or (p.sp and (t.seq_length // p.cp) % p.tp):
        return False
    if derived.data_parallel_size(cfg) == 0 or derived.expert_data_parallel_size(cfg) == 0:
        return False
    if cfg.parallel.fsdp and cfg.parallel.pp > 1:  # rule fsdp.no_pipeline
        return False
    micro = derived.num_microbatches(cfg)
    if micro == 0 or (p.pp > 1 and micro < p.pp) or (p.vpp and micro % p.pp):
        return False
    return pipeline_split_problem(cfg) is None


def _core(cfg: RunConfig) -> tuple:
    """The degrees that place weights and groups; vpp, micro batch and recompute only tune a layout."""
    p = cfg.parallel
    return (p.tp, p.pp, p.cp, p.ep, p.etp)


def search_layouts(cfg: RunConfig, top: int = 5, max_validated: int = 400, progress: bool = False) -> SearchResult:
    """The ``top`` fastest layouts (by the analytic model) that pass every validation rule; when the
    recipe's own sharding leaves fewer, the next sharding modes (``sharding.escalations``) are searched too,
    cheapest first, and their layouts carry the mode's overrides."""
    result = _search_mode(cfg, top, max_validated, None, progress)
    for name, escalated in sharding.escalations(cfg):
        if len(result.best) >= top:
            break
        more = _search_mode(escalated, top - len(result.best), max_validated, name, progress)
        result = SearchResult(result.best + more.best, result.screened + more.screened,
                              result.enumerated + more.enumerated, result.rejected + more.rejected)
    return result


def _search_mode(cfg: RunConfig, top: int, max_validated: int, mode: Optional[str], progress: bool) -> SearchResult:
    from megatron_recipes.progress import Progress

    label = f" ({mode})" if mode else ""
    enumerated, ranked = 0, []
    with Progress(f"plan --search{label}: estimating", unit="layouts", enabled=progress) as bar:
        for cand in enumerate_layouts(cfg):
            enumerated += 1
            bar.update(1)
            if not _screen(cand):
                continue
            memory = estimate_memory(cand)
            if not memory.fits:
                continue
            ranked.append(Candidate(cand, estimate_step_time(cand, build_group_map(cand)), memory, mode))
    ranked.sort(key=lambda c: c.time.total)
    best: List[Candidate] = []
    rejected: Counter = Counter()
    seen = set()
    shortlist = ranked[:max_validated]
    with Progress(f"plan --search{label}: validating", total=len(shortlist), unit="layouts", enabled=progress) as bar:
        for cand in shortlist:
            bar.update(1)
            core = _core(cand.cfg)
            if core in seen:  # a faster variant (vpp, micro batch, recompute) of this layout is listed already
                continue
            violations = validate(cand.cfg, rules=PLAN_RULES)
            if violations:
                rejected.update(v.rule_id for v in violations)
                continue
            best.append(cand)
            seen.add(core)
            if len(best) >= top:
                break
    return SearchResult(best=best, screened=len(ranked), enumerated=enumerated, rejected=rejected)
