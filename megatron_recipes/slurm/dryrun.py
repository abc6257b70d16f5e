"""``--dry-run``: the exact sbatch, srun and per-node commands, computed by the code that runs them.

The per-node lines come from the in-container entry's own ``plan_exec`` fed with each node's Slurm
variables; values only known once the job runs (job id, head node, port) stay as the shell variables
the batch script sets.
"""

from __future__ import annotations

import shlex
from typing import List, Sequence

from megatron_recipes._launch.entry import plan_exec
from megatron_recipes.slurm import commands
from megatron_recipes.slurm.commands import LaunchPlan, ShellExpr, shell_word
from megatron_recipes.slurm.script import JOB_CONFIG


def display_line(argv: Sequence[str]) -> str:
    """Like the script's quoting, but words holding $VARIABLES stay expandable (double quotes)."""
    def word(a: str) -> str:
        a = str(a)
        return '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"' if "$" in a else shlex.quote(a)
    return " ".join(word(a) for a in argv)


def _node_env(plan: LaunchPlan, node: int, local: int = 0) -> dict:
    c = plan.cfg.cluster
    tasks = plan.tasks_per_node
    return {
        "SLURM_JOB_ID": "$SLURM_JOB_ID",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node * tasks + local),
        "SLURM_LOCALID": str(local),
        "SLURM_NTASKS": str(c.nodes * tasks),
        "SLURM_NTASKS_PER_NODE": str(tasks),
        "MASTER_ADDR": "$MASTER_ADDR",
        "MASTER_PORT": "$MASTER_PORT",
    }


def _node_line(plan: LaunchPlan, node: int, local: int = 0) -> str:
    argv, extra = plan_exec(plan.cfg, [ShellExpr(JOB_CONFIG)], _node_env(plan, node, local), slurm=True,
                            module=plan.module, python=plan.python)
    env = " ".join(f"{k}={v}" for k, v in extra.items())
    return (env + " " if env else "") + display_line(argv)


def describe(plan: LaunchPlan, script_path: str) -> str:
    c = plan.cfg.cluster
    srun = ["srun", *commands.srun_args(plan)]
    entry = commands.entry_argv(plan, ShellExpr(JOB_CONFIG))
    out: List[str] = [
        "# dry run: nothing was written or submitted",
        f"sbatch --parsable {shell_word(script_path)}",
        f"# batch shell, on the first node: MASTER_ADDR=<first of scontrol show hostnames> "
        f"MASTER_PORT={commands.port_shell_expr()}",
        f"#   JOB_RUN_DIR={shell_word(plan.run_dir)} (run.dir as the ranks see it)",
        display_line(srun + entry),
    ]
    if c.launcher == "torchrun":
        out.append("# node 0 (head: hosts the c10d rendezvous store):")
        out.append(_node_line(plan, 0))
        if c.nodes > 1:
            rest = "node 1" if c.nodes == 2 else f"nodes 1..{c.nodes - 1}, each"
            out.append(f"# {rest}:")
            out.append(_node_line(plan, 1))
    else:
        for node in range(min(c.nodes, 2)):
            for local in range(plan.tasks_per_node):
                out.append(f"# node {node}, task {local}:")
                out.append(_node_line(plan, node, local))
        if c.nodes > 2:
            out.append(f"# ... nodes 2..{c.nodes - 1} likewise (RANK = node * {plan.tasks_per_node} + task)")
    return "\n".join(out) + "\n"
