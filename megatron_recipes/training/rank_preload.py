"""Imported once, by the server that forks the ranks of check runs, of local runs on the CPU lane and of the
tests (runtime/ranks.py).

Why: a tiny check run is mostly interpreter start-up (torch, megatron-core, Hydra, the trainer: ~4 s of
CPU each, and torch's compiler stack again when the optimizer is built). Imported here once, each rank
forks from the state a fresh rank reaches after those imports. The order is the entry point's:
``patches.apply("process")`` before megatron-core is imported. Only imports (and Hydra's override grammar,
built once): no process group, no CPU lane, no seed, no recipe, nothing read from one run's environment
(each rank gets its own at start); then what they created is frozen out of garbage collection.
"""

from megatron_recipes.training.cli import quiet_known_warnings

quiet_known_warnings()  # as the entry point does first; else the server prints them into the check's output

from megatron_recipes.runtime import patches  # noqa: E402

patches.apply("process")

import torch._dynamo  # noqa: E402,F401  (torch.optim imports it when the first optimizer is built)

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401

import megatron_recipes.checkpoint  # noqa: E402,F401
import megatron_recipes.config.compose  # noqa: E402,F401
import megatron_recipes.data.datasets  # noqa: E402,F401
import megatron_recipes.models.builder  # noqa: E402,F401
import megatron_recipes.training.loop  # noqa: E402,F401
import megatron_recipes.validation.validate  # noqa: E402,F401

from megatron_recipes.config import sweep  # noqa: E402

sweep.expand(["train.train_iters=1"], multirun=False)  # Hydra's override grammar, built once here (~60 ms per rank)

import gc  # noqa: E402

# What was imported lives as long as the server and every rank forked from it: leave it out of every later
# garbage collection (a full one walked all of it, ~0.17 s per collection in each rank; megatron-core's
# checkpoint saves collect twice), which also keeps the shared pages shared.
gc.freeze()
