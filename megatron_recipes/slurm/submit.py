"""Write the script where the job's logs go and hand it to ``sbatch --parsable`` (optionally ``--wait``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, TextIO

from megatron_recipes import files
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.slurm.commands import LaunchPlan
from megatron_recipes.slurm.script import render_script


@dataclass
class Submission:
    job_id: str
    script: str
    batch_log: str
    node_logs: str
    exit_code: Optional[int] = None  # set with --wait: the job's exit status as sbatch reports it


def write_script(text: str, path: str) -> str:
    """Atomic write, executable: a failed render never leaves a half script behind."""
    files.write_text(path, text)
    os.chmod(path, 0o755)
    return path


def _sbatch() -> str:
    exe = shutil.which("sbatch")
    if exe is None:
        raise RecipeError("sbatch is not on PATH: this is not a Slurm login node",
                          fix="run `megatron-recipes slurm render ... --out job.sbatch` here and submit it on the cluster")
    return exe


def submit(plan: LaunchPlan, *, wait: bool = False, out: TextIO = sys.stdout) -> Submission:
    sbatch = _sbatch()
    os.makedirs(plan.log_dir, exist_ok=True)  # Slurm opens --output before the script runs
    script = write_script(render_script(plan), plan.script_path)
    argv = [sbatch, "--parsable"] + (["--wait"] if wait else []) + [script]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline().strip() if proc.stdout else ""
    job_id = first.split(";")[0]
    if not job_id.isdigit():
        _, err = proc.communicate()
        raise RecipeError(f"sbatch rejected the job: {(first + ' ' + err).strip()}",
                          fix="read Slurm's message above (account, partition, time and GPU requests come from cluster.*)")
    sub = Submission(job_id, script, plan.batch_log(job_id), os.path.join(plan.log_dir, job_id))
    print(f"submitted job {job_id}", file=out)
    print(f"  script:    {script}", file=out)
    print(f"  batch log: {sub.batch_log}", file=out)
    print(f"  node logs: {sub.node_logs}/restart-<n>/<node>.log", file=out, flush=True)
    if wait:
        _, err = proc.communicate()
        sub.exit_code = proc.returncode
        if err.strip():
            print(err.strip(), file=sys.stderr)
        print(f"job {job_id} finished with exit code {sub.exit_code}", file=out, flush=True)
    else:
        proc.communicate()
    return sub
