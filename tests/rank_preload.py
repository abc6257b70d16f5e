"""Imported once, by the forkserver that forks every ``multiproc.run_ranks`` rank of a test session.

Why: each rank used to be a fresh interpreter importing torch, megatron-core and the training stack
(~5 s of CPU, ~200 ranks per suite). Forked from a server that imported them once, a rank starts in
milliseconds from exactly the state a fresh rank reaches after those imports. The order is the entry
points' order: ``patches.apply("process")`` before megatron-core is imported. Only imports: no process
group, no CPU lane, no seed, nothing read from the environment of one test (ranks get the caller's
environment when they start; ``multiproc._rank_entry``).
"""

from megatron_recipes.runtime import patches

patches.apply("process")

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
