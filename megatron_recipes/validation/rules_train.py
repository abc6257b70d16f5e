"""Rules on the training loop: batch shape, recompute, optimizer and learning-rate schedule."""

from __future__ import annotations

from typing import Optional

from megatron_recipes.config import derived, peft_methods
from megatron_recipes.config.schema import DECAY_STYLES, OPTIMIZERS, RECOMPUTE, RECOMPUTE_METHODS, RunConfig
from megatron_recipes.validation.rules_base import choices, divisors, layers_ok, one_of, rule, world_ok


@rule(
    "batch.positive",
    ["train.global_batch_size", "train.micro_batch_size", "train.seq_length", "train.train_iters"],
    "batch sizes and sequence length are >= 1; train_iters >= 0 (0 writes a step-0 seed checkpoint and stops)",
    "set them to positive integers (train.train_iters=0 only for a seed checkpoint)",
)
def _batch_positive(cfg: RunConfig) -> Optional[str]:
    t = cfg.train
    bad = [f"train.{n}={getattr(t, n)} must be >= 1" for n in ("global_batch_size", "micro_batch_size", "seq_length") if getattr(t, n) < 1]
    if t.train_iters < 0:
        bad.append(f"train.train_iters={t.train_iters} must be >= 0")
    return ", ".join(bad) if bad else None


@rule(
    "train.seed_run",
    ["train.train_iters", "checkpoint.pretrained", "peft.method"],
    "train.train_iters=0 writes a seed checkpoint of fresh step-0 base weights: no checkpoint.pretrained (it would "
    "not be loaded) and peft.method=none",
    "for a seed checkpoint set checkpoint.pretrained=null and peft=none; to start from pretrained weights, train "
    "train.train_iters >= 1 steps",
)
def _seed_run(cfg: RunConfig) -> Optional[str]:
    if cfg.train.train_iters != 0:
        return None
    bad = [f"checkpoint.pretrained={cfg.checkpoint.pretrained} would not be loaded"] if cfg.checkpoint.pretrained else []
    if peft_methods.why_not(cfg.peft.method) is None and not peft_methods.parse(cfg.peft.method).none:
        bad.append(f"peft.method={cfg.peft.method} has no adapters to seed")
    return "train.train_iters=0 writes fresh step-0 base weights: " + "; ".join(bad) if bad else None


@rule(
    "batch.global_divisible",
    ["train.global_batch_size", "train.micro_batch_size", "parallel.tp", "parallel.pp", "parallel.cp", "cluster.nodes"],
    "global_batch_size is divisible by micro_batch_size * DP (whole microbatches on every DP rank)",
    "adjust train.global_batch_size or train.micro_batch_size",
)
def _gbs_divisible(cfg: RunConfig) -> Optional[str]:
    t = cfg.train
    if not world_ok(cfg) or t.micro_batch_size < 1 or t.global_batch_size < 1:
        return None
    dp = derived.data_parallel_size(cfg)
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step == 0:
        return None
    lower = t.global_batch_size // per_step * per_step
    near = [g for g in (lower, lower + per_step) if g > 0]
    mbs = [m for m in divisors(t.global_batch_size // dp) if m <= 16] if t.global_batch_size % dp == 0 else []
    hint = f"use train.global_batch_size in {choices(near)}"
    if mbs:
        hint += f" or train.micro_batch_size in {choices(mbs)}"
    return (
        f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size={t.micro_batch_size} "
        f"x DP={dp} = {per_step}; {hint}"
    )


@rule(
    "recompute.values",
    ["train.recompute", "train.recompute_method"],
    "train.recompute is none, selective or full; recompute_method is uniform or block",
    "use a listed value",
)
def _recompute_values(cfg: RunConfig) -> Optional[str]:
    t = cfg.train
    return one_of(t.recompute, RECOMPUTE, "train.recompute") or one_of(t.recompute_method, RECOMPUTE_METHODS, "train.recompute_method")


@rule(
    "recompute.num_layers",
    ["train.recompute_num_layers", "train.recompute", "parallel.pp", "parallel.vpp"],
    "full recompute checkpoints 1..(layers per model chunk) layers at a time",
    "set train.recompute_num_layers between 1 and the layers of one (virtual) pipeline stage",
)
def _recompute_layers(cfg: RunConfig) -> Optional[str]:
    t = cfg.train
    if t.recompute != "full" or not layers_ok(cfg):
        return None
    chunk = max(len(c) for stage in derived.pipeline_stage_layers(cfg) for c in stage)
    if 1 <= t.recompute_num_layers <= chunk:
        return None
    return f"train.recompute_num_layers={t.recompute_num_layers} must be in [1, {chunk}] (layers per model chunk)"


@rule(
    "optimizer.name",
    ["optimizer.name"],
    "the optimizer is adam (AdamW) or sgd",
    "use optimizer=adam or optimizer=sgd",
)
def _opt_name(cfg: RunConfig) -> Optional[str]:
    return one_of(cfg.optimizer.name, OPTIMIZERS, "optimizer.name")


@rule(
    "optimizer.distributed_needs_adam",
    ["optimizer.name", "optimizer.use_distributed_optimizer"],
    "megatron-core's distributed optimizer shards Adam state; it does not implement SGD",
    "set optimizer.use_distributed_optimizer=false with optimizer=sgd (recipes/optimizer/sgd.yaml does)",
)
def _distributed_needs_adam(cfg: RunConfig) -> Optional[str]:
    o = cfg.optimizer
    if o.name == "sgd" and o.use_distributed_optimizer:
        return "megatron-core's distributed optimizer implements Adam only, not optimizer.name=sgd with optimizer.use_distributed_optimizer=true"
    return None


@rule(
    "optimizer.learning_rate",
    ["optimizer.lr", "optimizer.min_lr"],
    "0 < lr and 0 <= min_lr <= lr",
    "set optimizer.lr > 0 and optimizer.min_lr at most lr (often lr / 10)",
)
def _lr(cfg: RunConfig) -> Optional[str]:
    o = cfg.optimizer
    if o.lr <= 0:
        return f"optimizer.lr={o.lr} must be > 0"
    if not 0 <= o.min_lr <= o.lr:
        return f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]"
    return None


@rule(
    "optimizer.schedule",
    ["optimizer.lr_decay_style", "optimizer.lr_warmup_iters", "optimizer.lr_decay_iters", "train.train_iters"],
    "decay style is cosine/linear/constant and warm-up ends before the decay horizon",
    "shorten optimizer.lr_warmup_iters or lengthen optimizer.lr_decay_iters",
)
def _schedule(cfg: RunConfig) -> Optional[str]:
    o = cfg.optimizer
    bad = one_of(o.lr_decay_style, DECAY_STYLES, "optimizer.lr_decay_style")
    if bad:
        return bad
    decay = derived.lr_decay_iters(cfg)
    if o.lr_decay_iters is not None and o.lr_decay_iters < 1:
        return f"optimizer.lr_decay_iters={o.lr_decay_iters} must be >= 1 (or null for train.train_iters)"
    if o.lr_warmup_iters is None or cfg.train.train_iters == 0:
        return None  # a seed checkpoint takes no step; a fraction (rule optimizer.warmup_fraction) always ends before the horizon
    if o.lr_warmup_iters < 0 or (o.lr_warmup_iters >= decay and o.lr_decay_style != "constant"):
        return f"optimizer.lr_warmup_iters={o.lr_warmup_iters} must be in [0, {decay}) (the decay horizon)"
    return None


@rule(
    "optimizer.warmup_fraction",
    ["optimizer.lr_warmup_fraction", "optimizer.lr_warmup_iters"],
    "lr_warmup_fraction is in [0, 1): warm-up lasts floor(fraction x decay horizon) steps "
    "(an explicit lr_warmup_iters, when set, is used instead)",
    "set optimizer.lr_warmup_fraction between 0 and 1 (e.g. 0.02), or null to use optimizer.lr_warmup_iters",
)
def _warmup_fraction(cfg: RunConfig) -> Optional[str]:
    f = cfg.optimizer.lr_warmup_fraction
    if f is None or 0 <= f < 1:
        return None
    return f"optimizer.lr_warmup_fraction={f} must be in [0, 1)"


@rule(
    "optimizer.hyperparameters",
    ["optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.adam_eps", "optimizer.weight_decay", "optimizer.clip_grad", "optimizer.sgd_momentum"],
    "Adam betas in [0, 1), eps > 0, weight decay and clipping >= 0, SGD momentum in [0, 1)",
    "use values like beta1=0.9 beta2=0.95 eps=1e-8 weight_decay=0.1 clip_grad=1.0",
)
def _hyper(cfg: RunConfig) -> Optional[str]:
    o = cfg.optimizer
    checks = [
        (0 <= o.adam_beta1 < 1, f"optimizer.adam_beta1={o.adam_beta1} must be in [0, 1)"),
        (0 <= o.adam_beta2 < 1, f"optimizer.adam_beta2={o.adam_beta2} must be in [0, 1)"),
        (o.adam_eps > 0, f"optimizer.adam_eps={o.adam_eps} must be > 0"),
        (o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0"),
        (o.clip_grad >= 0, f"optimizer.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)"),
        (0 <= o.sgd_momentum < 1, f"optimizer.sgd_momentum={o.sgd_momentum} must be in [0, 1)"),
    ]
    return next((msg for ok, msg in checks if not ok), None)


@rule(
    "optimizer.overlap_needs_distributed",
    ["parallel.overlap_param_gather", "optimizer.use_distributed_optimizer"],
    "overlapping the parameter all-gather needs the distributed optimizer (it is what gathers parameters)",
    "set optimizer.use_distributed_optimizer=true, or parallel.overlap_param_gather=false",
)
def _overlap(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.overlap_param_gather and not cfg.optimizer.use_distributed_optimizer:
        return "parallel.overlap_param_gather=true with optimizer.use_distributed_optimizer=false"
    return None


TRAIN_RULES = [
    _batch_positive,
    _seed_run,
    _gbs_divisible,
    _recompute_values,
    _recompute_layers,
    _opt_name,
    _distributed_needs_adam,
    _lr,
    _schedule,
    _warmup_fraction,
    _hyper,
    _overlap,
]
