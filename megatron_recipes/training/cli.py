"""``megatron-recipes train <recipe> [overrides]``: train here, or start the local ranks first.

Under a launcher (torchrun or Slurm set ``RANK``) this process is one rank and trains. Started by
hand on a single node, it validates the recipe once and then starts ``cluster.gpus_per_node`` ranks
itself (runtime/local_launch.py: forked from a preloaded server on the CPU lane, through torchrun's own
launcher with CUDA), stopping every rank when one dies; its exit code is the job's. Multi-node jobs are
started per node by torchrun or ``megatron-recipes slurm``. ``-m`` (``--multirun``) with comma lists
(``optimizer.lr=1e-3,2e-3``) trains one run per combination, one after another, each in its own subfolder
of ``run.dir`` (``config/sweep.py``).
"""

from __future__ import annotations

import os
import sys
from typing import List, Sequence

from megatron_recipes.cli_args import hydra_cfg, split_args
from megatron_recipes.config import derived
from megatron_recipes.config.errors import RecipeError

PROG = "megatron-recipes train"
FLAGS = {"cfg": True}  # Hydra's --cfg job
_LAUNCHER_VARS = ("RANK", "TORCHELASTIC_RUN_ID")


def quiet_known_warnings() -> None:
    """The known third-party warnings hidden and counted (runtime/known_warnings.py owns the list)."""
    from megatron_recipes.runtime.known_warnings import quiet

    quiet()


def under_launcher() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARS)


def _compose(argv: Sequence[str]):
    from megatron_recipes.config.compose import compose_recipe

    args = split_args(argv, PROG, flags=FLAGS)
    return args, compose_recipe(args.recipe, args.overrides)


def set_rank_environment(cfg, environ=os.environ) -> List[str]:
    """What a Slurm job script exports but a single-node start (``train``, ``run_single_node.sh``, the
    in-container entry, a bare torchrun) would lack: CUDA_DEVICE_MAX_CONNECTIONS, which megatron-core's
    TP/CP communication overlap needs before CUDA initialises. A value the user set is kept."""
    from megatron_recipes.slurm.environment import cuda_device_max_connections

    notes = []
    for var in cuda_device_max_connections(cfg):
        if var.name in environ:
            continue
        environ[var.name] = var.value
        notes.append(f"{var.name}={var.value} ({var.why})")
    return notes


def run_rank(recipe: str, cfg, validated: bool = False) -> int:
    """Train the composed ``cfg`` on this process as one rank of the job (``validated``: this process
    has already run ``loop.validate`` on this very ``cfg``, so the run does not repeat it)."""
    from megatron_recipes.training.loop import run

    for note in set_rank_environment(cfg):
        if os.environ.get("RANK", "0") == "0":
            print(f"environment: {note}", flush=True)
    try:
        return run(cfg, recipe, validated=validated)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line from rank 0, not a traceback per rank
        if os.environ.get("RANK", "0") == "0":
            from megatron_recipes import checkpoint

            last = checkpoint.latest(cfg)
            print(f"interrupted (Ctrl-C): nothing was saved since the last checkpoint; the same command resumes from "
                  f"{last if last else 'the start (no checkpoint yet)'}", file=sys.stderr, flush=True)
        return 130


def _rank_count(cfg) -> int:
    import torch

    if cfg.cluster.nodes > 1:
        raise RecipeError(
            f"cluster.nodes={cfg.cluster.nodes}: a multi-node job cannot be started from one shell",
            fix="use `megatron-recipes slurm submit <recipe>`, or run torchrun on every node "
            "(torchrun --nnodes N --nproc_per_node G -m megatron_recipes.train <recipe> ...)",
        )
    n = cfg.cluster.gpus_per_node
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise RecipeError(
            f"cluster.gpus_per_node={n} but this machine has {torch.cuda.device_count()} GPU(s)",
            fix=f"set cluster.gpus_per_node={torch.cuda.device_count()} (and a layout that fits), or pick another cluster",
        )
    return n


def main(argv: List[str]) -> int:
    """Entry of ``megatron-recipes train`` and ``python -m megatron_recipes.train``."""
    quiet_known_warnings()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} <recipe> [key=value ...] [-m key=a,b ...]\n\n{__doc__}")
        return 0
    from megatron_recipes.config.sweep import expand, take_multirun

    argv, multirun = take_multirun(argv)
    args = split_args(argv, PROG, flags=FLAGS)
    sweep = expand(args.overrides, multirun)
    if sweep is not None and not under_launcher():  # -m: one run per combination, one after another
        from megatron_recipes.training.sweep import run_sweep

        if args.flags.get("cfg"):  # --cfg job: each combination's resolved recipe, nothing validated or trained
            from megatron_recipes.config.compose import compose_recipe

            for combination in sweep:
                base = compose_recipe(args.recipe, combination.overrides).run.dir
                print(f"# sweep run {combination.name}")
                hydra_cfg(args.flags["cfg"], compose_recipe(args.recipe, combination.with_run_dir(base)))
            return 0
        return run_sweep(args.recipe, sweep)
    args, cfg = _compose(argv)  # once per process: composition costs seconds of CPU
    recipe = args.recipe
    if hydra_cfg(args.flags.get("cfg"), cfg):  # --cfg job: the resolved recipe, nothing trained
        return 0
    if under_launcher():
        return run_rank(recipe, cfg)
    from megatron_recipes.training.loop import NothingToTrain, validate

    try:
        validate(cfg, recipe)  # report a bad recipe once, before any rank starts
    except NothingToTrain as done:
        print(done, flush=True)
        return 0
    world = derived.world_size(cfg)
    if world == 1:
        return run_rank(recipe, cfg, validated=True)
    from megatron_recipes.runtime.local_launch import spawn_local

    return spawn_local(argv, _rank_count(cfg), tokenizers=cfg.data.kind == "sft", compiles=derived.is_moe(cfg.model))
