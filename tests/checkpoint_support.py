"""Shared pieces of the checkpoint tests: a very small Llama recipe, the real trainer set-up, fixed data.

The model, DDP, optimizer, scheduler and training step are the project's own (models.builder,
training.optim, training.step) on megatron-core; only the data is synthetic (fixed random tokens per
step), so every layout sees the same global batch.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch

SEQ = 16
GBS = 4
VOCAB = 256
# ~10M parameters: a save writes ~150 MB (seconds), long enough to kill a rank in it or train beside it.
BIG = [
    "model.num_layers=4",
    "model.hidden_size=384",
    "model.num_attention_heads=6",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=1152",
    "model.vocab_size=4096",
]


def tiny_cfg(run_dir: str, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, world: int = 1, extra=()):
    """4 layers x 64 hidden, fp32, Adam with warm-up (so LR and optimizer moments both matter on resume)."""
    from megatron_recipes.config.compose import compose_recipe

    overrides = [
        f"run.dir={run_dir}",
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        f"cluster.gpus_per_node={world}",
        "model.num_layers=4",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=128",
        f"model.vocab_size={VOCAB}",
        "model.max_position_embeddings=64",
        f"train.seq_length={SEQ}",
        f"train.global_batch_size={GBS}",
        "train.micro_batch_size=1",
        "train.train_iters=10",
        "optimizer.lr=1e-2",
        "optimizer.min_lr=1e-3",
        "optimizer.lr_warmup_iters=2",
        "precision=fp32",
        *extra,
    ]
    if vpp:
        overrides.append(f"parallel.vpp={vpp}")
    return compose_recipe("tiny_llama_cpu", overrides)


class Trainer:
    """What the training loop holds: wrapped chunks, optimizer, scheduler, forward step."""

    def __init__(self, cfg, seed: Optional[int] = None) -> None:
        from megatron_recipes.models.builder import build_model_chunks
        from megatron_recipes.runtime import distributed
        from megatron_recipes.training import optim, step

        self.cfg = cfg
        self.runtime = distributed.init_model_parallel(cfg)
        if seed is not None:
            distributed.seed_everything(seed)
        self.model = optim.wrap_model(cfg, build_model_chunks(cfg))
        self.optimizer = optim.build_optimizer(cfg, self.model)
        self.scheduler = optim.build_scheduler(cfg, self.optimizer)
        optim.configure_schedule_hooks(cfg, self.model, self.optimizer)
        self.forward_step = step.make_forward_step(self.runtime.device, False)

    def train(self, first_step: int, last_step: int) -> List[float]:
        """Steps first..last (inclusive) on the fixed data; the global-batch loss of each."""
        from megatron_recipes.training import step

        losses = []
        for n in range(first_step, last_step + 1):
            iters = [iter(_micro_batches(n)) for _ in self.model]
            result = step.train_step(
                self.cfg, self.model, self.optimizer, self.scheduler, iters, self.forward_step, self.runtime.device
            )
            losses.append(result.loss)
        return losses

    def logits(self) -> Optional[torch.Tensor]:
        """Full-vocabulary logits of a fixed batch (on last-stage ranks; None elsewhere)."""
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = _batch(tokens_seed=999, rows=slice(0, 1))
        micro = 2  # the interleaved schedule wants at least PP micro-batches; both are the same batch
        captured: List[torch.Tensor] = []

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            out = model(item["tokens"], item["position_ids"], None)

            def grab(output):
                full = tensor_parallel.gather_from_tensor_model_parallel_region(output)
                captured.append(full.detach().clone())
                return output.sum() * 0, torch.tensor(1, dtype=torch.int), {}

            return out, grab

        for chunk in self.model:
            chunk.eval()
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter([batch] * micro) for _ in self.model] if len(self.model) > 1 else iter([batch] * micro),
                model=self.model,
                num_microbatches=micro,
                seq_length=SEQ,
                micro_batch_size=1,
                forward_only=True,
            )
        for chunk in self.model:
            chunk.train()
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        return captured[0] if (last and captured) else None

    def optimizer_tensors(self) -> List[torch.Tensor]:
        """This rank's optimizer state tensors (Adam moments, main params), in a fixed order."""
        out = []
        for part in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    out.append(param.detach().clone())
                    for key in sorted(inner.state.get(param, {})):
                        value = inner.state[param][key]
                        if torch.is_tensor(value):
                            out.append(value.detach().clone())
        return out

    def param_tensors(self) -> Dict[str, torch.Tensor]:
        from megatron_recipes.checkpoint._mcore import unwrap

        return {
            f"{i}.{name}": p.detach().clone()
            for i, chunk in enumerate(unwrap(self.model))
            for name, p in chunk.named_parameters()
        }


def rng_draws() -> Dict[str, Any]:
    """One draw from every RNG stream a training step may use (advances them)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return {"torch": torch.rand(4), "tracker": tracked, "python": random.random(), "numpy": float(np.random.rand())}


def _batch(tokens_seed: int, rows: slice) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens_seed)
    data = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=gen)[rows]
    n = data.shape[0]
    return {
        "tokens": data[:, :-1].contiguous(),
        "labels": data[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(n, SEQ).contiguous(),
        "loss_mask": torch.ones(n, SEQ),
    }


def _micro_batches(step_number: int) -> List[Dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the fixed global batch of ``step_number``."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = GBS // dp
    return [_batch(1000 + step_number, slice(rank * per_rank + i, rank * per_rank + i + 1)) for i in range(per_rank)]


def checksum(model) -> float:
    """A float64 digest of every weight (equal digests after a load mean the weights came back)."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model:
        for i, p in enumerate(chunk.parameters()):
            total += (p.detach().double() * (1.0 + 1e-3 * i)).sum()
    return float(total)
