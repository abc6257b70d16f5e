"""The recipe a conversion works in: the converted model, a target layout, and checks that it can run.

Conversion is not a training run, but it builds (shape-only or real) megatron-core models and writes a
checkpoint a trainer resumes from, so it speaks ``RunConfig`` like everything else. The layout is
checked with the recipe rules when they are available, plus the three rules a converted model meets
first: heads/query groups vs TP, layers vs PP x VPP, experts vs EP.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Dict, List, Optional, Sequence

from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)

DTYPES = ("bf16", "fp32")
PARALLEL_KEYS = ("tp", "pp", "ep", "etp", "vpp")


def parse_parallel(options: Dict[str, str], prog: str) -> ParallelConfig:
    """``parallel.tp=2 parallel.pp=2 ...`` -> ParallelConfig (unset keys keep the schema defaults)."""
    values: Dict[str, Optional[int]] = {}
    for key, raw in options.items():
        name = key.split(".", 1)[1]
        if name not in PARALLEL_KEYS:
            raise RecipeError(f"{prog}: unknown option '{key}'", fix=f"layout options: {', '.join('parallel.' + k for k in PARALLEL_KEYS)}")
        if raw.lower() in ("null", "none", ""):
            values[name] = None
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise RecipeError(f"{prog}: {key}={raw!r} is not an integer", fix=f"e.g. {key}=2") from None
        if values[name] < 1:
            raise RecipeError(f"{prog}: {key}={raw} must be >= 1 (a parallel degree)", fix=f"e.g. {key}=2, or leave it out for 1")
    return ParallelConfig(**values)


def min_world_size(parallel: ParallelConfig) -> int:
    """The fewest ranks that hold a layout: tp*pp*cp*dp with dp the least making tp*cp*dp a multiple of etp*ep."""
    etp = parallel.etp if parallel.etp is not None else parallel.tp
    base = parallel.tp * parallel.cp
    expert = etp * parallel.ep
    dp = expert // math.gcd(base, expert)
    return base * dp * parallel.pp


def run_config(model: ModelConfig, parallel: ParallelConfig, dtype: str, seq_length: int = 0, world: Optional[int] = None) -> RunConfig:
    """A complete RunConfig for converting ``model`` at ``parallel`` (stored as the checkpoint's config.yaml)."""
    world = world or min_world_size(parallel)
    seq = seq_length or min(model.max_position_embeddings, 4096)
    parallel = with_required_sp(model, parallel)
    return RunConfig(
        model=model,
        parallel=parallel,
        cluster=ClusterConfig(
            name="conversion", nodes=1, gpus_per_node=world, nvlink_domain=world, gpu_memory_gb=0.0, gpu_arch="cpu"
        ),
        precision=PrecisionConfig(name=dtype, params_dtype=dtype),
        data=DataConfig(kind="mock"),
        optimizer=OptimizerConfig(lr=1e-5),
        train=TrainConfig(global_batch_size=world, micro_batch_size=1, seq_length=seq, train_iters=1),
    )


def with_required_sp(model: ModelConfig, parallel: ParallelConfig) -> ParallelConfig:
    """megatron-core runs MoE layers under TP only with sequence parallelism."""
    if model.num_moe_experts and parallel.tp > 1 and not parallel.sp:
        return dataclasses.replace(parallel, sp=True)
    return parallel


def with_parallel(cfg: RunConfig, parallel: ParallelConfig, world: Optional[int] = None) -> RunConfig:
    """The same model and precision at another layout (e.g. verifying a checkpoint on fewer ranks)."""
    world = world or min_world_size(parallel)
    parallel = with_required_sp(cfg.model, parallel)
    cluster = dataclasses.replace(cfg.cluster, nodes=1, gpus_per_node=world, nvlink_domain=world)
    train = dataclasses.replace(cfg.train, global_batch_size=world // (parallel.tp * parallel.pp * parallel.cp) or 1, micro_batch_size=1)
    return dataclasses.replace(cfg, parallel=parallel, cluster=cluster, train=train)


def _own_checks(cfg: RunConfig) -> List[str]:
    m, p = cfg.model, cfg.parallel
    problems: List[str] = []
    if p.tp < 1 or p.pp < 1 or p.ep < 1 or (p.etp is not None and p.etp < 1) or (p.vpp is not None and p.vpp < 1):
        return [f"parallel degrees must be >= 1 (tp={p.tp} pp={p.pp} ep={p.ep} etp={p.etp} vpp={p.vpp})"]
    if not m.multi_latent_attention:
        if m.num_attention_heads % p.tp:
            problems.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={p.tp}")
        if m.num_query_groups % p.tp:
            ok = [t for t in range(1, m.num_query_groups + 1) if m.num_query_groups % t == 0]
            problems.append(f"model.num_query_groups={m.num_query_groups} is not divisible by parallel.tp={p.tp}; use tp in {ok}")
    elif m.num_attention_heads % p.tp:
        problems.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={p.tp}")
    stages = p.pp * (p.vpp or 1)
    if p.vpp and p.pp < 2:
        problems.append(f"parallel.vpp={p.vpp} needs parallel.pp >= 2")
    if m.num_layers % stages:
        problems.append(f"model.num_layers={m.num_layers} is not divisible by parallel.pp x vpp = {stages}")
    if m.num_moe_experts:
        if m.num_moe_experts % p.ep:
            problems.append(f"model.num_moe_experts={m.num_moe_experts} is not divisible by parallel.ep={p.ep}")
    elif p.ep > 1:
        problems.append(f"parallel.ep={p.ep} needs a mixture-of-experts model (this one is dense)")
    return problems


# The recipe rules that concern a checkpoint's model and layout (not batch, data, cluster or memory).
# ``mla.no_qkv_options`` is left out: megatron-core's MLA needs qk_layernorm for DeepSeek's latent norms.
LAYOUT_RULES = (
    "layout.degrees_positive",
    "layout.expert_factorisation",
    "tp.attention_heads",
    "tp.query_groups",
    "tp.ffn_hidden",
    "pp.layer_split",
    "pp.vpp_value",
    "model.query_groups_divide_heads",
    "model.head_dim",
    "model.option_values",
    "model.rope_settings",
    "vocab.padding",
    "mla.fields",
    "mla.rope",
    "moe.ep_needs_experts",
    "moe.settings_need_experts",
    "moe.experts_divisible_by_ep",
    "moe.router_topk",
    "moe.group_routing",
    "moe.router_options",
    "moe.first_dense_layers",
    "moe.tp_needs_sp",
    "etp.expert_ffn",
)


def _recipe_rules(cfg: RunConfig) -> Optional[str]:
    """The project's rule table (``config.validate``), restricted to ``LAYOUT_RULES``; its report, or None."""
    try:
        validate = importlib.import_module("megatron_recipes.config.validate")
        rules = importlib.import_module("megatron_recipes.config.rules")
    except ModuleNotFoundError:
        return None
    chosen = [r for r in rules.RULES if r.id in LAYOUT_RULES]
    violations = validate.validate(cfg, rules=chosen)
    return "\n".join("  " + v.render() for v in violations) or None


def check_layout(cfg: RunConfig) -> None:
    problems = _own_checks(cfg)
    if problems:
        raise RecipeError(
            "the target layout cannot hold this model:\n  - " + "\n  - ".join(problems),
            fix="choose parallel.tp/pp/vpp/ep values that divide the model as listed",
        )
    report = _recipe_rules(cfg)
    if report:
        raise RecipeError(f"the target layout breaks the recipe rules:\n{report}", fix="adjust parallel.* as the rules say")


def model_from_fields(fields: Dict[str, object], name: str) -> ModelConfig:
    """ModelConfig from a family's derived fields; unknown names fail loudly (a mapping bug)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise RecipeError(f"conversion mapping produced unknown ModelConfig field(s) {unknown}", fix="fix the family mapping file")
    return ModelConfig(name=name, **fields)  # type: ignore[arg-type]


def layout_string(p: ParallelConfig) -> str:
    parts: Sequence[str] = [f"tp={p.tp}", f"pp={p.pp}"] + ([f"vpp={p.vpp}"] if p.vpp else []) + ([f"ep={p.ep}"] if p.ep > 1 else [])
    if p.etp is not None:
        parts = list(parts) + [f"etp={p.etp}"]
    return " ".join(parts)
