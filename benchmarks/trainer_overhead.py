"""Our trainer's step time against a minimal hand-written megatron-core loop, side by side in one run.

    python benchmarks/trainer_overhead.py [recipe] [overrides ...]      (default: tiny_llama_cpu)

Both loops train the same model (``models.builder.build_model_chunks``: the model is not the trainer)
on the same data, in the same processes (torchrun ranks started here), alternating blocks of steps so
that load changes on the machine hit both alike. The trainer's side is ``Trainer.advance()``: the whole
per-step body of ``megatron-recipes train`` (data iterator, loss reduction across ranks, NaN check,
logging, preemption poll). The hand-written side is what anyone would write with megatron-core alone:
DDP, ``get_megatron_optimizer``, ``OptimizerParamScheduler``, ``get_forward_backward_func`` over
pre-loaded batches. Prints the median step times and their ratio (goal: <= 1.03).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import List

BLOCKS, STEPS_PER_BLOCK, WARMUP = 6, 8, 3


def hand_written_loop(cfg, batches: List[dict]):
    """Model, DDP, optimizer, schedule and loss with megatron-core calls only; returns ``step()``."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_recipes.models.builder import build_model_chunks

    chunks = build_model_chunks(cfg)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
    model = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    from megatron_recipes.config import derived

    o = cfg.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer=o.name, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                        use_distributed_optimizer=o.use_distributed_optimizer, bf16=config.bf16, params_dtype=config.params_dtype),
        model,
    )
    scheduler = OptimizerParamScheduler(optimizer, 0.0, o.lr, o.min_lr, derived.lr_warmup_iters(cfg), cfg.train.train_iters, o.lr_decay_style,
                                         o.weight_decay, o.weight_decay, cfg.train.train_iters, "constant")
    forward_backward = get_forward_backward_func()
    t = cfg.train
    n_micro = len(batches)

    def loss_func(mask, output):
        loss = (output.float().view(-1) * mask.view(-1)).sum()
        return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}

    def forward_step(it, m):
        b = next(it)
        return m(b["tokens"], b["position_ids"], None, labels=b["labels"]), partial(loss_func, b["loss_mask"])

    def step():
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        iters = [iter(batches) for _ in model]
        forward_backward(forward_step_func=forward_step, data_iterator=iters if len(model) > 1 else iters[0], model=model,
                         num_microbatches=n_micro, seq_length=t.seq_length, micro_batch_size=t.micro_batch_size)
        optimizer.step()
        scheduler.step(increment=1)

    return step


def rank_main(argv: List[str]) -> int:
    import torch

    from megatron_recipes.config import derived
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training.cli import quiet_known_warnings
    from megatron_recipes.training.loop import Trainer

    quiet_known_warnings()
    recipe = argv[0] if argv and "=" not in argv[0] else "tiny_llama_cpu"
    overrides = [a for a in argv if "=" in a]
    run_dir = tempfile.mkdtemp(prefix="trainer-overhead-")
    fixed = [f"run.dir={run_dir}", "train.train_iters=100000", "checkpoint.save=false", "checkpoint.load=none",
             "logging.eval_interval=100000", "logging.plot=false", "logging.tensorboard=false", "optimizer.lr_warmup_iters=10"]
    cfg = compose_recipe(recipe, fixed + overrides)
    runtime = distributed.init_model_parallel(cfg)
    trainer = Trainer(cfg, runtime)
    trainer.setup()
    it = trainer._iterators(trainer.train_ds, 0)[0]
    batches = [next(it) for _ in range(derived.num_microbatches(cfg))]
    hand_step = hand_written_loop(cfg, batches)
    sync = torch.distributed.barrier

    def timed(fn) -> List[float]:
        out = []
        for _ in range(STEPS_PER_BLOCK):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
        return out

    for _ in range(WARMUP):
        trainer.advance()
        hand_step()
    ours, theirs = [], []
    for block in range(BLOCKS):  # alternate which goes first, so drift in machine load hits both alike
        first, second = (trainer.advance, hand_step) if block % 2 == 0 else (hand_step, trainer.advance)
        a, b = timed(first), timed(second)
        ours += a if first is trainer.advance else b
        theirs += b if first is trainer.advance else a
    if runtime.rank == 0:
        mo, mt = statistics.median(ours), statistics.median(theirs)
        p = cfg.parallel
        print(f"\n{recipe}: TP={p.tp} PP={p.pp} DP={derived.data_parallel_size(cfg)} on {runtime.world_size} rank(s), "
              f"{len(ours)} steps each, global batch {cfg.train.global_batch_size} x {cfg.train.seq_length} tokens")
        print(f"  megatron-recipes trainer step : {mo * 1000:8.1f} ms (median)")
        print(f"  hand-written mcore loop step  : {mt * 1000:8.1f} ms (median)")
        print(f"  ratio trainer / hand-written  : {mo / mt:8.3f}   (goal <= 1.03)")
    trainer.close()
    distributed.shutdown()
    return 0


def main(argv: List[str]) -> int:
    if "RANK" in os.environ:
        return rank_main(argv)
    from megatron_recipes.config import derived
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.runtime.local_launch import spawn_local

    recipe = argv[0] if argv and "=" not in argv[0] else "tiny_llama_cpu"
    cfg = compose_recipe(recipe, [a for a in argv if "=" in a] + ["run.dir=unused"])
    return spawn_local(argv, derived.world_size(cfg), target=[os.path.abspath(__file__)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
