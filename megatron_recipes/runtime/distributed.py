"""Process groups: torch.distributed + megatron-core's parallel_state, from a recipe.

One place decides the device and backend: NCCL on CUDA, gloo plus the CPU lane when CUDA is absent.
Works under torchrun (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*), under our own local launchers (which host
the rendezvous store, ``hosted_store``) and as a single process (a one-rank group, in memory), which
conversion and tests use.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.runtime import cpu_lane

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    cpu_lane: bool


def hosted_store(world_size: int) -> "tuple[dist.TCPStore, dict[str, str]]":
    """The rendezvous store a launcher hosts for the local ranks it starts, as torchrun's agent does, and the
    environment that points the ranks at it (all of them connect as clients; keep the store until they end).

    Why: a port picked free, released, and bound again later by rank 0 could be taken in between by any other
    process on the machine (an outgoing connection gets a port from the same range): the run then failed with
    EADDRINUSE, as CI saw with two test workers starting runs side by side. Here the kernel gives the port
    while the store is bound to it, so there is no window."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, env


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init_process_group(timeout_minutes: float = 10.0) -> Runtime:
    """Start torch.distributed (idempotent). Activates the CPU lane first when there is no GPU."""
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_lane.activate()
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        # A one-rank group meets nobody: an in-memory store, no port, the environment left alone. Writing
        # MASTER_PORT into os.environ (as it did) handed a port this process still listened on to every
        # subprocess started after, whose own one-rank group then failed with EADDRINUSE; reading a
        # MASTER_PORT a shell or a parent left behind failed the same way.
        store = dist.HashStore() if world == 1 else None
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world, timeout=timedelta(minutes=timeout_minutes)
        )
    return Runtime(rank, world, local_rank, device, backend, cpu_lane=not use_cuda)


def check_world_matches(cfg: RunConfig, world: int) -> None:
    expected = derived.world_size(cfg)
    if world != expected:
        raise RecipeError(
            f"{world} process(es) were started but the recipe's cluster is cluster.nodes={cfg.cluster.nodes} x "
            f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} = {expected} ranks",
            fix=f"start {expected} processes (torchrun --nproc_per_node {cfg.cluster.gpus_per_node} on each node), "
            f"or set cluster.nodes/cluster.gpus_per_node to match {world}",
        )


def embedding_ranks(cfg: RunConfig):
    """The pipeline ranks whose word-embedding gradients megatron-core all-reduces, as Megatron-LM's
    pretrain_gpt chooses them: the first stage, the last when it holds the tied output layer, and the stage
    holding the MTP layers (which embeds with its own copy). megatron-core's default (first and last) made a
    pipeline layout with MTP on another stage train silently wrong: with MTP set it reduces every member's
    ``shared_embedding_or_output_weight``, which on an untied last stage is the output layer."""
    mtp = derived.mtp_pipeline_rank(cfg)
    tied = cfg.model.tie_embeddings

    def choose(pp_ranks, *_):
        ranks = {pp_ranks[0]}
        if len(pp_ranks) > 1 and tied:
            ranks.add(pp_ranks[-1])
        if len(pp_ranks) > 1 and mtp is not None:
            ranks.add(pp_ranks[mtp])
        return sorted(ranks)

    return choose


def init_model_parallel(cfg: RunConfig, timeout_minutes: float = 10.0) -> Runtime:
    """Process group + megatron-core parallel_state for the recipe's layout, and seeded RNG trackers."""
    from megatron.core import parallel_state

    runtime = init_process_group(timeout_minutes)
    check_world_matches(cfg, runtime.world_size)
    p = cfg.parallel
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        hierarchical_context_parallel_sizes=p.cp_hierarchical_sizes,  # a2a+p2p's groups (rule cp.hierarchical_sizes)
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=derived.expert_tensor_parallel_size(cfg),
        distributed_timeout_minutes=int(max(1, timeout_minutes)),
        # hybrid sharding: megatron-core builds the intra-/inter-instance DP groups the optimizer uses
        num_distributed_optimizer_instances=p.dist_optimizer_instances,
        order="tp-cp-ep-dp-pp",
        get_embedding_ranks=embedding_ranks(cfg),
    )
    seed_everything(cfg.seed)
    return runtime


# Megatron-LM's per-rank offsets (initialize.py _set_random_seed): each pipeline stage builds different
# layers, and stages seeded alike would start those layers equal. Data-parallel replicas keep one seed
# (Megatron-LM's data_parallel_random_init, off by default: replicas must start identical).
PIPELINE_SEED_STRIDE = 100


def rank_seed(seed: int, pipeline_rank: int) -> int:
    """The seed of one pipeline stage; megatron-core offsets TP/EP ranks on top of it."""
    return seed + PIPELINE_SEED_STRIDE * pipeline_rank


def seed_everything(seed: int) -> None:
    """Seed this rank as Megatron-LM does: the recipe's seed offset by the pipeline stage for Python, NumPy
    and torch, then megatron-core's tracker (TP/EP streams) from the same stage seed. On the CPU lane the
    tracker's "CUDA" states are the CPU generator's (cpu_lane, patch cpu-rng-state), so the offset reaches
    the CPU initialisation too. No TE RNG tracker: Megatron-LM turns it on only for CUDA graphs."""
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = rank_seed(seed, parallel_state.get_pipeline_model_parallel_rank())
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
