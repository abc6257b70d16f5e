"""What a validation rule is, plus the small helpers rule checks share (divisors, value lists, the
pipeline split of the layers), which ``plan --search`` uses too.

A rule is data: an id, the fields it reads, a check returning ``None`` (fine) or a message that names
the offending values and the valid ones, a one-line statement of the rule, a fix, and a scope saying
which command judges it (``SCOPES``). Rules whose inputs are already broken by a more basic rule return
``None`` so every problem is reported once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

from megatron_recipes.config import derived
from megatron_recipes.config.schema import RunConfig

Check = Callable[..., Optional[str]]  # (cfg) or, for scopes in HOST_SCOPES, (cfg, host)
Fix = Union[str, Callable[[RunConfig], str]]

# Which command judges a rule. `train` runs recipe + input + machine, `check` recipe + input (minus the
# inputs it brings itself) + machine, `plan` recipe only, `slurm` recipe + input + launch (+ host paths).
SCOPES = {
    "recipe": "the recipe against the cluster it declares (every command)",
    "input": "files and checkpoints a training run reads (train, slurm; plan never opens them)",
    "launch": "Slurm settings that would fail only after the job waited in the queue (slurm)",
    "machine": "what the machine the run starts on can honour: GPU, Transformer Engine, DeepEP (train, check)",
}
HOST_SCOPES = ("launch", "machine")  # their checks also read the host they run on (a ``Host``)
DEFAULT_SCOPES = ("recipe", "input")


@dataclass(frozen=True)
class Host:
    """What host-scoped checks may look at: whether local paths are judged, and the machine's abilities
    (``models.capabilities.Machine``)."""

    check_paths: bool = True
    machine: Any = None  # required by machine rules (``capabilities`` passes the detected one)


@dataclass(frozen=True)
class Rule:
    id: str
    fields: Tuple[str, ...]
    check: Check
    message: str  # the rule itself, one line (shown in docs and `plan --rules`)
    fix: Fix
    scope: str = "recipe"  # a key of SCOPES
    needs: Optional[str] = None  # scope "input": the input it requires (a command that brings it skips the rule)
    model_layout: bool = False  # reads only the model and its layout: a conversion target is checked by it

    def fix_text(self, cfg: RunConfig) -> str:
        return self.fix(cfg) if callable(self.fix) else self.fix

    def run(self, cfg: RunConfig, host: Host) -> Optional[str]:
        if self.scope == "machine" and host.machine is None:
            raise RuntimeError(f"rule {self.id} judges a machine: pass Host(machine=capabilities.detect())")
        return self.check(cfg, host) if self.scope in HOST_SCOPES else self.check(cfg)


def rule(id: str, fields: Sequence[str], message: str, fix: Fix, scope: str = "recipe", needs: Optional[str] = None,
         model_layout: bool = False) -> Callable[[Check], Rule]:
    """Decorator: turn a check function into a ``Rule`` entry of the table."""
    if scope not in SCOPES or (scope == "input") != (needs is not None):
        raise ValueError(f"rule {id}: scope {scope!r} (one of {sorted(SCOPES)}); input rules, and only they, name what they need")

    def wrap(check: Check) -> Rule:
        return Rule(id=id, fields=tuple(fields), check=check, message=message, fix=fix, scope=scope, needs=needs,
                    model_layout=model_layout)

    return wrap


def divisors(n: int) -> List[int]:
    n = abs(int(n))
    return [d for d in range(1, n + 1) if n % d == 0] if n else []


def choices(values: Iterable[object], limit: int = 12) -> str:
    vals = list(values)
    if not vals:
        return "{} (none)"
    shown = ", ".join(str(v) for v in vals[:limit])
    return "{" + shown + (", ..." if len(vals) > limit else "") + "}"


def fmt_ranks(ranks: Sequence[int]) -> str:
    """A rank list, shortened in the middle when long."""
    ranks = list(ranks)
    shown = ranks if len(ranks) <= 8 else ranks[:4] + ["..."] + ranks[-1:]
    return "[" + ", ".join(map(str, shown)) + "]"


def one_of(value: object, allowed: Sequence[object], field: str) -> Optional[str]:
    if value in allowed:
        return None
    return f"{field}={value!r} is not one of {choices(allowed)}"


def is_gpu(cfg: RunConfig) -> bool:
    return cfg.cluster.gpu_arch != "cpu"


def degrees_ok(cfg: RunConfig) -> bool:
    p = cfg.parallel
    etp = derived.expert_tensor_parallel_size(cfg)
    basic = all(isinstance(d, int) and d >= 1 for d in (p.tp, p.pp, p.cp, p.ep, etp))
    return basic and (p.vpp is None or p.vpp >= 1) and cfg.cluster.nodes >= 1 and cfg.cluster.gpus_per_node >= 1


# Above any cluster built (the largest published training jobs ran on about 100,000 GPUs): a larger world is
# a typo, and building its groups enumerates every rank of every group (minutes of silence at a million
# nodes), so the rules that build them skip it (rule layout.world_bounded says why)
MAX_WORLD = 262_144


def world_ok(cfg: RunConfig) -> bool:
    """Both megatron-core rank generators can be built (dense and expert layouts factorise the world)."""
    return (degrees_ok(cfg) and derived.world_size(cfg) <= MAX_WORLD and derived.data_parallel_size(cfg) > 0
            and derived.expert_data_parallel_size(cfg) > 0)


def layers_ok(cfg: RunConfig) -> bool:
    """The pipeline split of the layers is valid (so per-stage quantities mean something)."""
    return degrees_ok(cfg) and pipeline_split_problem(cfg) is None


def model_ok(cfg: RunConfig) -> bool:
    """The architecture is self-consistent (so parameter and activation formulas apply)."""
    m = cfg.model
    if min(m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.vocab_size) < 1:
        return False
    if m.multi_latent_attention:
        dims = (m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim)
        if not all(d and d >= 1 for d in dims):
            return False
    elif m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups:
        return False
    if not m.kv_channels and not m.multi_latent_attention and m.hidden_size % m.num_attention_heads:
        return False
    if m.num_moe_experts is not None and not 1 <= m.moe_router_topk <= m.num_moe_experts:
        return False
    return True


def batch_ok(cfg: RunConfig) -> bool:
    t = cfg.train
    return world_ok(cfg) and min(t.global_batch_size, t.micro_batch_size, t.seq_length) >= 1 and derived.num_microbatches(cfg) > 0


def blocks_cross_domain(world: int, block: int, domain: int) -> bool:
    """Whether contiguous rank blocks of ``block`` (how TP, and ETP x EP, groups are laid out in
    megatron-core's order) straddle an NVLink-domain boundary somewhere in ``world``."""
    domain = max(1, domain)
    return any(start // domain != (start + block - 1) // domain for start in range(0, world, block))


def valid_tp_values(cfg: RunConfig) -> List[int]:
    """TP degrees that split heads, query groups and FFN, factorise the world and stay in NVLink."""
    m, p = cfg.model, cfg.parallel
    world = derived.world_size(cfg)
    out = []
    for tp in divisors(m.num_attention_heads):
        if not m.multi_latent_attention and m.num_query_groups % tp:
            continue
        if m.ffn_hidden_size % tp or world % (tp * max(1, p.pp) * max(1, p.cp)):
            continue
        if is_gpu(cfg) and not p.allow_inter_node_tp and blocks_cross_domain(world, tp, cfg.cluster.nvlink_domain):
            continue
        out.append(tp)
    return out


def _account_proposal(layers: int, pp: int, vpp: int) -> str:
    """The account_for_* overrides that make ``layers`` split over pp x vpp, or ''."""
    for emb, loss in ((1, 1), (1, 0), (0, 1)):
        if (layers + emb + loss) % (pp * vpp) == 0:
            flags = [f"parallel.account_for_{n}_in_pipeline_split=true" for n, on in (("embedding", emb), ("loss", loss)) if on]
            return (
                f"; {' '.join(flags)} counts the {' and the '.join(n for n, on in (('embedding', emb), ('loss', loss)) if on)} "
                f"as a layer: {layers}+{emb + loss} = {layers + emb + loss} = {pp}x{vpp}x{(layers + emb + loss) // (pp * vpp)} "
                "slots per virtual stage (the first/last chunk then builds one layer fewer)"
            )
    return ""


def pipeline_split_problem(cfg: RunConfig) -> Optional[str]:
    """Why the layers cannot be split over pp x vpp (megatron-core's even/uneven rules, or the stages of
    ``parallel.pipeline_layout``), or None."""
    p, layers = cfg.parallel, cfg.model.num_layers
    if p.pipeline_layout:
        from megatron_recipes.config import pipeline_layout

        found = pipeline_layout.problems(p.pipeline_layout, p.pp, p.vpp, layers, cfg.model.mtp_num_layers)
        return "; ".join(found) if found else None
    vpp = p.vpp or 1
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    emb, loss = int(p.account_for_embedding_in_pipeline_split), int(p.account_for_loss_in_pipeline_split)
    if (emb or loss) and (first is not None or last is not None):
        return (
            "parallel.account_for_embedding/loss_in_pipeline_split cannot be combined with "
            "parallel.num_layers_in_first/last_pipeline_stage (megatron-core accepts one way of splitting unevenly)"
        )
    if first is None and last is None:
        slots = layers + emb + loss
        if slots % (p.pp * vpp):
            ok = [d for d in divisors(slots // vpp if slots % vpp == 0 else 0)]
            counted = f"model.num_layers={layers}" + (f" + {emb + loss} (embedding/loss counted as layers)" if emb or loss else "")
            return (
                f"{counted} is not divisible by parallel.pp*vpp = {p.pp}*{vpp} = {p.pp * vpp}; "
                f"use parallel.pp in {choices(ok)} (with vpp={p.vpp}), or set "
                "parallel.num_layers_in_first/last_pipeline_stage" + ("" if emb or loss else _account_proposal(layers, p.pp, vpp))
            )
        return None
    if p.pp < 2:
        return "parallel.num_layers_in_first/last_pipeline_stage need parallel.pp > 1"
    middle_layers, middle_ranks = layers, p.pp
    for name, n in (("first", first), ("last", last)):
        if n is None:
            continue
        if n <= 0 or n % vpp:
            return f"parallel.num_layers_in_{name}_pipeline_stage={n} must be > 0 and divisible by vpp={vpp}"
        middle_layers -= n
        middle_ranks -= 1
    if middle_layers < 0 or bool(middle_layers) != bool(middle_ranks):
        return f"{middle_layers} layers remain for {middle_ranks} middle stages (num_layers={layers}, pp={p.pp})"
    if middle_ranks and (middle_layers % middle_ranks or (middle_layers // middle_ranks) % vpp):
        return (
            f"the {middle_layers} middle layers do not split evenly over {middle_ranks} middle stages x vpp={vpp}; "
            f"adjust num_layers_in_first/last_pipeline_stage so that num_layers - first - last is a multiple of "
            f"{middle_ranks * vpp}"
        )
    return None
