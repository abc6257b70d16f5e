"""Slurm's own value syntax: time limits, signal names, and the sbatch/srun options the recipe owns.

Kept below the rule table: the launch rules (``validation/rules_launch.py``, scope ``launch``) read settings
through these; the script renderer spells signals with them.
"""

from __future__ import annotations

import re
import signal
from typing import Optional

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MEM = re.compile(r"^\d+[KMGT]?$")  # sbatch --mem: a number, optionally with a K/M/G/T unit (M when none)
MEM_PER_UNIT = ("--mem-per-cpu", "--mem-per-gpu")  # sbatch refuses them beside --mem
# Options the recipe owns (option -> the field that sets it): set through cluster.* so the layout, the
# rendezvous and the requeue agree.
OWNED_OPTIONS = {
    "--nodes": "cluster.nodes", "-N": "cluster.nodes", "--ntasks-per-node": "cluster.gpus_per_node/launcher",
    "--ntasks": "cluster.nodes/gpus_per_node", "-n": "cluster.nodes/gpus_per_node",
    "--gpus-per-node": "cluster.gpus_per_node", "--gres": "cluster.gpus_per_node",
    "--cpus-per-task": "cluster.cpus_per_task", "-c": "cluster.cpus_per_task", "--mem": "cluster.mem",
    "--time": "cluster.time_limit", "-t": "cluster.time_limit", "--account": "cluster.account",
    "-A": "cluster.account", "--partition": "cluster.partition", "-p": "cluster.partition",
    "--signal": "cluster.preempt_signal/preempt_signal_lead_s", "--requeue": "(always set)",
    "--no-requeue": "cluster.max_restarts=0", "--output": "run.dir", "-o": "run.dir", "--error": "run.dir",
    "-e": "run.dir", "--job-name": "run.name", "-J": "run.name", "--mpi": "cluster.launcher",
    "--kill-on-bad-exit": "(always 1)", "--container-image": "cluster.container_image",
    "--container-mounts": "cluster.container_mounts", "--container-workdir": "cluster.container_workdir",
}
_FORBIDDEN_SIGNALS = ("SIGKILL", "SIGSTOP")


def time_limit_seconds(text: str) -> Optional[int]:
    """Slurm's time formats -> seconds; None for unlimited; raises ValueError if unreadable."""
    t = str(text).strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(t)
    if not m:
        raise ValueError(t)
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(nums) == 1:
        return nums[0] * 60  # M
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]  # M:S
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]  # H:M:S


def signal_name(text: str) -> Optional[str]:
    """'USR1' / 'SIGUSR1' / '10' -> 'USR1' (Slurm's spelling), None if not a signal."""
    t = str(text).strip().upper()
    try:
        sig = signal.Signals(int(t)) if t.isdigit() else signal.Signals[t if t.startswith("SIG") else "SIG" + t]
    except (KeyError, ValueError):
        return None
    return None if sig.name in _FORBIDDEN_SIGNALS else sig.name[3:]


def option_name(arg: str) -> str:
    text = arg.strip()
    if text.startswith("#SBATCH"):
        text = text[len("#SBATCH"):].strip()
    return text.split("=", 1)[0].split()[0] if text else ""
