"""The command lines of a launch, built in one place for the sbatch script, the dry run and the entry.

``srun`` (in the batch script) starts ``python -m megatron_recipes._launch.entry`` once per node
(torchrun launcher) or once per GPU (pmix launcher); the entry then runs ``torchrun_argv`` or
``rank_argv``. Because the dry run calls the same functions, what it prints is what runs.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron_recipes.config.schema import RunConfig
from megatron_recipes.config import container_flags as container

TRAIN_MODULE = "megatron_recipes.train"
PROBE_MODULE = "megatron_recipes.slurm.probe"
ENTRY_MODULE = "megatron_recipes._launch.entry"
LOG_SUBDIR = "slurm"
# Port of the rendezvous store on the head node, spread by job id so jobs sharing a node do not collide.
PORT_BASE, PORT_SPAN = 20000, 20000


class ShellExpr(str):
    """A word that refers to batch-script variables ("$RESTART_DIR/..."): double-quoted, not escaped."""


def port_shell_expr() -> str:
    return f"$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the script needs, decided once from the recipe (run.dir already absolute)."""

    cfg: RunConfig
    recipe: str
    overrides: Sequence[str]
    module: str = TRAIN_MODULE
    python: str = "python"  # inside a container: the image's; without: the interpreter that rendered
    mounts: List[container.Mount] = field(default_factory=list)

    @property
    def run_dir(self) -> str:
        """run.dir as the ranks see it (inside the container, if any)."""
        return self.cfg.run.dir

    @property
    def host_run_dir(self) -> str:
        """The same folder as the batch shell sees it, outside the container (through the mounts)."""
        return container.to_host_path(self.run_dir, self.mounts)

    @property
    def log_dir(self) -> str:
        """Host view: Slurm and the batch shell write the logs."""
        return os.path.join(self.host_run_dir, LOG_SUBDIR)

    @property
    def job_name(self) -> str:
        return self.cfg.run.name

    @property
    def tasks_per_node(self) -> int:
        c = self.cfg.cluster
        return 1 if c.launcher == "torchrun" else c.gpus_per_node

    @property
    def cpus_per_task(self) -> Optional[int]:
        """cluster.cpus_per_task is the CPU budget of one node; pmix splits it over the node's ranks."""
        c = self.cfg.cluster
        if not c.cpus_per_task:
            return None
        return max(1, c.cpus_per_task // self.tasks_per_node)

    @property
    def uses_gpus(self) -> bool:
        return self.cfg.cluster.gpu_arch != "cpu"

    @property
    def script_path(self) -> str:
        return os.path.join(self.log_dir, f"{self.job_name}.sbatch")

    def batch_log(self, job_id: str = "%j") -> str:
        return os.path.join(self.log_dir, f"{self.job_name}-{job_id}.out")


def default_python(cfg: RunConfig) -> str:
    return "python" if container.image_of(cfg.cluster) else sys.executable


def gpu_flag(c) -> str:
    """The GPU request of one node, as the cluster's scheduler takes it (cluster.gpu_request)."""
    return f"--gres=gpu:{c.gpus_per_node}" if c.gpu_request == "gres" else f"--gpus-per-node={c.gpus_per_node}"


def srun_args(plan: LaunchPlan) -> List[str]:
    """srun's options, unquoted (``ShellExpr`` items are expanded by the batch shell)."""
    c = plan.cfg.cluster
    args = [f"--nodes={c.nodes}", f"--ntasks-per-node={plan.tasks_per_node}"]
    if plan.cpus_per_task:
        args.append(f"--cpus-per-task={plan.cpus_per_task}")  # srun no longer inherits it from sbatch
    if plan.uses_gpus:
        args.append(gpu_flag(c))
    if c.launcher == "pmix":
        args += ["--mpi=pmix", "--label"]
    args += ["--kill-on-bad-exit=1", ShellExpr("--output=$RESTART_DIR/node%n-%N.log")]
    if container.image_of(c):
        args += container.pyxis_args(container.image_of(c), plan.mounts, c.container_workdir)
    args += [str(a) for a in c.srun_extra]
    return args


def entry_argv(plan: LaunchPlan, config_path: str) -> List[str]:
    """What srun runs on every node (or every GPU): the in-container entry with the job's config."""
    argv = [plan.python, "-m", ENTRY_MODULE, "--slurm"]
    if plan.module != TRAIN_MODULE:
        argv += ["--module", plan.module]
    return argv + [config_path]


def torchrun_argv(
    cfg: RunConfig,
    target: Sequence[str],
    *,
    python: str,
    module: str,
    node_rank: int,
    head: Optional[str],
    port: Optional[int | str],
    run_id: str,
) -> List[str]:
    """One torchrun per node. Multi-node: c10d rendezvous whose store lives on the head node (node 0)."""
    c = cfg.cluster
    argv = [python, "-m", "torch.distributed.run", f"--nnodes={c.nodes}", f"--nproc-per-node={c.gpus_per_node}"]
    if c.nodes == 1 and head is None:
        argv.append("--standalone")
    else:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={head}:{port}",
            f"--rdzv-id={run_id}",
            # node 0 hosts the store; the others only connect (never a silent second store)
            f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}",
        ]
    argv += ["--max-restarts=0", "-m", module, *target]
    return argv


def rank_argv(target: Sequence[str], *, python: str, module: str) -> List[str]:
    """pmix launcher: srun already started one process per GPU; each runs the module directly."""
    return [python, "-m", module, *target]


def rank_env(slurm_env: Dict[str, str], head: str, port: int | str) -> Dict[str, str]:
    """torch.distributed's env:// variables from Slurm's per-task ones (pmix launcher)."""
    return {
        "RANK": slurm_env["SLURM_PROCID"],
        "WORLD_SIZE": slurm_env["SLURM_NTASKS"],
        "LOCAL_RANK": slurm_env["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": slurm_env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or "1",
        "NODE_RANK": slurm_env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": head,
        "MASTER_PORT": str(port),
    }


def shell_line(argv: Sequence[str]) -> str:
    return " ".join(shell_word(a) for a in argv)


def shell_word(arg: str) -> str:
    """Quote for bash: literals single-quoted (spaces, quotes, $ survive), ShellExpr double-quoted."""
    if isinstance(arg, ShellExpr):
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(str(arg))
