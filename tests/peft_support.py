"""Shared helpers for the PEFT tests: real gloo ranks (``multiproc.run_ranks``), tiny recipes, fixed batches."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

SEQ = 32


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600.0) -> List[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks; return each rank's result (rank order): ``multiproc.run_ranks``
    (this argument order is the PEFT tests')."""
    from multiproc import run_ranks as run

    return run(fn, world, *args, timeout=timeout)


# The tiny setting these tests share (sharding_support reuses it with larger global batches).
TINY_BASE = [
    "precision=fp32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    f"train.seq_length={SEQ}",
    "optimizer.lr_warmup_iters=0",
    "optimizer.lr_decay_style=constant",
    "optimizer.lr=1.0e-2",
    "checkpoint.pretrained=unused-by-this-test",
]


def tiny_cfg(world: int, *overrides: str, recipe: str = "tiny_llama_cpu"):
    from megatron_recipes.config.compose import compose_recipe

    base = ["parallel=none", f"cluster.gpus_per_node={world}", *TINY_BASE]
    return compose_recipe(recipe, base + list(overrides))


def fixed_batches(cfg, steps: int, seed: int = 7) -> List[Dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches of ``steps`` global batches, the same global batches for
    every layout. Each sequence repeats a short random motif (a pattern the model can learn)."""
    from megatron.core import parallel_state

    from megatron_recipes.config import derived

    g = torch.Generator().manual_seed(seed)
    mbs, seq = cfg.train.micro_batch_size, cfg.train.seq_length
    per_global = cfg.train.global_batch_size // mbs
    per_rank = derived.num_microbatches(cfg)
    dp_rank = parallel_state.get_data_parallel_rank()
    out = []
    for _ in range(steps):
        global_batch = []
        for _ in range(per_global):
            motif = torch.randint(0, 200, (mbs, 4), generator=g)
            stream = motif.repeat(1, (seq + 1) // 4 + 1)[:, : seq + 1]
            global_batch.append(
                {
                    "tokens": stream[:, :-1].contiguous(),
                    "labels": stream[:, 1:].contiguous(),
                    "loss_mask": torch.ones(mbs, seq),
                    "position_ids": torch.arange(seq).expand(mbs, seq).contiguous(),
                }
            )
        out += global_batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return out


def snapshot_frozen(chunks) -> Dict[str, torch.Tensor]:
    """Every frozen tensor the model holds (parameters and NF4 buffers), copied."""
    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                out[f"{i}.{name}"] = p.detach().clone()
        for name, b in chunk.named_buffers():
            if name.endswith(("qweight", "qabsmax", "qabsmax2", "qoffset")):
                out[f"{i}.{name}"] = b.detach().clone()
    return out


def _optimize(cfg, chunks, steps: int):
    """Wrap ``chunks`` in megatron-core DDP + optimizer and run ``steps`` steps on fixed batches."""
    from megatron_recipes.training import optim, step

    model = optim.wrap_model(cfg, chunks)
    optimizer = optim.build_optimizer(cfg, model)
    scheduler = optim.build_scheduler(cfg, optimizer)
    optim.configure_schedule_hooks(cfg, model, optimizer)
    forward_step = step.make_forward_step(torch.device("cpu"), use_te=False)
    batches = fixed_batches(cfg, steps)
    per_step = len(batches) // steps
    losses = []
    for s in range(steps):
        its = [iter(batches[s * per_step : (s + 1) * per_step]) for _ in model]
        losses.append(step.train_step(cfg, model, optimizer, scheduler, its, forward_step, torch.device("cpu")).loss)
    return model, optimizer, scheduler, losses


def train_steps(cfg, steps: int, after_build: Callable | None = None) -> Dict[str, Any]:
    """Build, apply PEFT, wrap in megatron-core DDP + optimizer, run ``steps`` steps on fixed batches."""
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.peft import apply_peft
    from megatron_recipes.runtime.distributed import init_model_parallel

    init_model_parallel(cfg)
    chunks = build_model_chunks(cfg)
    if after_build is not None:
        after_build(chunks)
    summary = apply_peft(chunks, cfg, report=False)
    frozen = snapshot_frozen(chunks)
    losses = _optimize(cfg, chunks, steps)[-1]
    after = snapshot_frozen(chunks)
    unchanged = sorted(frozen) == sorted(after) and all(torch.equal(frozen[k], after[k]) for k in frozen)
    return {"losses": losses, "frozen_unchanged": unchanged, "frozen_count": len(frozen),
            "trainable": summary.trainable, "total": summary.total, "chunks": chunks}


def set_base_weights(chunks, seed: int = 11) -> None:
    """Fill every parameter from its layout-free name, so TP/PP layouts hold the same model.

    Stands in for loading one pretrained checkpoint into different layouts: a tensor is drawn whole
    (gated FC1 as gate and up halves) and each rank keeps its tensor-parallel slice.
    """
    from megatron.core import parallel_state

    from megatron_recipes.peft.linears import normal, sharded
    from megatron_recipes.peft.linears import canonical_name

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            key = canonical_name(chunk, name)
            if ".experts." in name:
                tp = parallel_state.get_expert_tensor_parallel_world_size()
                rank = parallel_state.get_expert_tensor_parallel_rank()
            else:
                tp = parallel_state.get_tensor_model_parallel_world_size()
                rank = parallel_state.get_tensor_model_parallel_rank()
            with torch.no_grad():
                if "layernorm" in name or name.endswith("final_layernorm.weight"):
                    p.fill_(1.0)
                    continue
                sharded_here = getattr(p, "tensor_model_parallel", False)
                dim = p.partition_dim if sharded_here else 0
                full = list(p.shape)
                full[dim] *= tp if sharded_here else 1
                if name.endswith("linear_fc1.weight") and chunk.config.gated_linear_unit:
                    half = list(full)
                    half[0] //= 2
                    gate = sharded(normal(0.05), half, seed, key + ".gate", 0, rank, tp)
                    up = sharded(normal(0.05), half, seed, key + ".up", 0, rank, tp)
                    p.copy_(torch.cat([gate, up]))
                elif not sharded_here:
                    p.copy_(sharded(normal(0.05), full, seed, key))
                else:
                    p.copy_(sharded(normal(0.05), full, seed, key, dim, rank, tp))


# --- a tiny HF Llama converted to a checkpoint (the same architecture as recipes/model/tiny_llama.yaml) ---


def make_hf_llama(path, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(str(path))


def import_hf_llama(root: str) -> str:
    """``root/hf`` (a random tiny HF Llama) imported to ``root/base``; returns the checkpoint folder."""
    from pathlib import Path

    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert.importer import run_import

    root_path = Path(root)
    make_hf_llama(root_path / "hf")
    run_import(root_path / "hf", root_path / "base", ParallelConfig(), dtype="fp32", progress=False)
    return str(root_path / "base")


def train_and_save(world: int, run_dir: str, pretrained: str, steps: int, *overrides: str, inspect: Callable | None = None):
    """A PEFT run through the checkpoint engine (no data pipeline): pretrained base, adapters, save; its
    losses, or ``(losses, inspect(chunks))`` to read this rank's trained model."""
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.peft.state import prepare_for_training
    from megatron_recipes.runtime.distributed import init_model_parallel
    from megatron_recipes import checkpoint

    cfg = tiny_cfg(world, f"checkpoint.pretrained={pretrained}", f"run.dir={run_dir}", *overrides)
    init_model_parallel(cfg)
    chunks = build_model_chunks(cfg)
    checkpoint.start_of(cfg, adapters_only=True).load_weights(chunks)  # the base, as the trainer loads it
    prepare_for_training(cfg, chunks)
    model, optimizer, scheduler, losses = _optimize(cfg, chunks, steps)
    root = checkpoint.checkpoints_root(cfg)
    checkpoint.save(root, steps, model, optimizer, scheduler, {"step": steps}, cfg, keep_last=2)
    return losses if inspect is None else (losses, inspect(chunks))
