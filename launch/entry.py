"""In-container entry point: check the node, then start torchrun (or one rank) with the recipe.

srun runs ``python -m megatron_recipes._launch.entry --slurm <config.yaml>`` on every node (torchrun
launcher) or for every GPU (pmix launcher). Without ``--slurm`` it launches on this machine alone:
``python -m megatron_recipes._launch.entry <recipe> [overrides]`` (see ``run_single_node.sh``).

It refuses to start on what would otherwise fail late or silently: a multi-node job without a head
node address (torchrun would rendezvous on localhost), an allocation whose node count differs from
the recipe's, a GPU recipe on a node that sees fewer GPUs than it needs. The exact command is printed
before it replaces this process.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_recipes.cli_args import split_args
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.slurm import commands

PROG = "python -m megatron_recipes._launch.entry"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def node_problems(cfg: RunConfig, env: Mapping[str, str], *, slurm: bool, visible_gpus: Optional[int]) -> List[str]:
    """What is wrong with this node for this recipe (empty list: go)."""
    c, problems = cfg.cluster, []
    if slurm:
        nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        if nnodes and int(nnodes) != c.nodes:
            problems.append(f"the allocation has {nnodes} node(s) but the recipe's cluster.nodes={c.nodes}; "
                            f"resubmit with cluster.nodes={nnodes} or ask for {c.nodes} nodes")
        for name in ("SLURM_JOB_ID", "SLURM_NODEID"):
            if not env.get(name):
                problems.append(f"{name} is not set: run under srun, or drop --slurm to launch on this machine")
    if c.nodes > 1:
        head = env.get("MASTER_ADDR", "")
        if not head:
            problems.append(f"cluster.nodes={c.nodes} but MASTER_ADDR is not set: the head node's address must come "
                            "from the batch script (scontrol show hostnames), or torchrun would wait on localhost")
        elif head in _LOOPBACK_NAMES:
            problems.append(f"MASTER_ADDR={head} is a loopback address but the job spans {c.nodes} nodes; "
                            "other nodes cannot reach it")
        if not env.get("MASTER_PORT", "").isdigit():
            problems.append(f"MASTER_PORT={env.get('MASTER_PORT')!r} is not a port number")
        if not slurm and not env.get("NODE_RANK", "").isdigit():
            problems.append("a multi-node launch without Slurm needs NODE_RANK (0 on the node named by MASTER_ADDR)")
    if c.gpu_arch != "cpu" and visible_gpus is not None:
        need = c.gpus_per_node if c.launcher == "torchrun" or not slurm else 1
        if visible_gpus < need:
            problems.append(f"this node sees {visible_gpus} GPU(s) but the recipe needs {need} per "
                            f"{'node' if need > 1 else 'rank'} (cluster.gpus_per_node={c.gpus_per_node}); check "
                            "--gpus-per-node and that the container has GPU access")
    return problems


def _visible_gpus(cfg: RunConfig) -> Optional[int]:
    if cfg.cluster.gpu_arch == "cpu":
        return None
    import torch

    return torch.cuda.device_count()


def plan_exec(
    cfg: RunConfig,
    target: Sequence[str],
    env: Mapping[str, str],
    *,
    slurm: bool,
    module: str = commands.TRAIN_MODULE,
    python: str = sys.executable,
) -> tuple[List[str], Dict[str, str]]:
    """The argv this node runs and the variables it adds to the environment."""
    c = cfg.cluster
    if slurm and c.launcher == "pmix":
        extra = commands.rank_env(dict(env), env["MASTER_ADDR"], env["MASTER_PORT"])
        return commands.rank_argv(target, python=python, module=module), extra
    if slurm:
        node_rank, run_id = int(env["SLURM_NODEID"]), env["SLURM_JOB_ID"]
    else:
        node_rank, run_id = int(env.get("NODE_RANK", "0") or 0), env.get("MEGATRON_RECIPES_RUN_ID", "local")
    head = env.get("MASTER_ADDR") if (slurm or c.nodes > 1) else None
    argv = commands.torchrun_argv(cfg, target, python=python, module=module, node_rank=node_rank,
                                  head=head, port=env.get("MASTER_PORT"), run_id=run_id)
    return argv, {}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = split_args(list(sys.argv[1:] if argv is None else argv), PROG,
                      flags={"slurm": False, "module": True, "print-only": False})
    cfg = compose_recipe(args.recipe, args.overrides)
    slurm = bool(args.flags.get("slurm"))
    module = str(args.flags.get("module") or commands.TRAIN_MODULE)
    env = dict(os.environ)
    problems = node_problems(cfg, env, slurm=slurm, visible_gpus=_visible_gpus(cfg))
    where = env.get("SLURMD_NODENAME") or socket.gethostname()
    if problems and args.flags.get("print-only"):  # shows the command on any machine; says what this one lacks
        print(f"[megatron-recipes] note: node {where} could not start it:\n  - " + "\n  - ".join(problems), flush=True)
        problems = []
    if problems:
        raise RecipeError(f"node {where} cannot start the run:\n  - " + "\n  - ".join(problems),
                          fix="see each item above")
    target = [args.recipe, *args.overrides]
    run_argv, extra_env = plan_exec(cfg, target, env, slurm=slurm, module=module)
    tag = f"node {env.get('SLURM_NODEID', env.get('NODE_RANK', '0'))} ({where})"
    if extra_env:
        tag += " rank " + extra_env["RANK"]
        print(f"[megatron-recipes] {tag} env: " + " ".join(f"{k}={v}" for k, v in extra_env.items()), flush=True)
    print(f"[megatron-recipes] {tag} exec: {commands.shell_line(run_argv)}", flush=True)
    if args.flags.get("print-only"):
        return 0
    os.environ.update(extra_env)
    os.execvp(run_argv[0], run_argv)
    return 127  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RecipeError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        sys.exit(2)
