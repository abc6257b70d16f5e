"""The recipe a conversion works in: the converted model, a target layout, and checks that it can run.

Conversion is not a training run, but it builds (shape-only or real) megatron-core models and writes a
checkpoint a trainer resumes from, so it speaks ``RunConfig`` like everything else. The layout is
checked with the rule table's rules on the model and its layout (``Rule.model_layout``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence

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


def check_layout(cfg: RunConfig) -> None:
    """The target layout against the rule table's model-and-layout rules (``model_layout``), all reported."""
    from megatron_recipes.validation.rules import select
    from megatron_recipes.validation.validate import validate

    report = "\n".join("  " + v.render() for v in validate(cfg, rules=select(model_layout=True)))
    if report:
        raise RecipeError(f"the target layout cannot hold this model:\n{report}", fix="adjust parallel.* as the rules say")


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
