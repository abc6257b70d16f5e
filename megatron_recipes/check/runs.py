"""The check's training runs: each rank runs ``python -m megatron_recipes.train`` as a user starts it.

Why separate processes running the real entry point: the proof must cover what a user runs (composition,
rule table, the trainer on real gloo ranks, checkpoints), not a re-creation of it. The ranks are forked
from one preloaded server (runtime/ranks.py), so a run does not pay the imports again. Per-step numbers come
from each run's ``log.jsonl`` (also read while a run goes, for its progress bar); the full output of each
run is kept next to it (``<run>.log``). Runs that do not need each other's checkpoints go side by side
(``train_together``): a second core overlaps them.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_recipes.runtime import ranks
from megatron_recipes.progress import Progress
from megatron_recipes.training.sinks import step_records

RECIPE_ERROR = 2  # the CLI's exit code for a RecipeError


@dataclass
class RunResult:
    name: str
    returncode: int
    seconds: float
    run_dir: Path

    @property
    def output(self) -> str:
        path = self.run_dir.parent / f"{self.run_dir.name}.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""

    def series(self, key: str) -> Dict[int, float]:
        """step -> value for each step that logged ``key``."""
        path = self.run_dir / "log.jsonl"
        if not path.is_file():
            return {}
        return {int(r["step"]): float(r["data"][key]) for r in step_records(path) if isinstance(r["data"].get(key), (int, float))}


def _env(threads: Optional[int] = None) -> Dict[str, str]:
    env = dict(os.environ)
    # A rendezvous left in this environment must not leak into the ranks (runtime/ranks.py sets their own).
    for name in ranks.LAUNCHER_VARS:
        env.pop(name, None)
    if threads is not None and "OMP_NUM_THREADS" not in env:  # runs side by side share the cores
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def steps_logged(run_dir: Path) -> int:
    """The last training step a run has logged so far (0 before its first)."""
    path = run_dir / "log.jsonl"
    try:
        return max((int(r["step"]) for r in step_records(path)), default=0) if path.is_file() else 0
    except (OSError, ValueError):  # a line being written right now: count it next time
        return 0


def wait_all(procs: Sequence, run_dirs: Sequence[Path], timeout: float, bar: Progress,
             poll: float = 1.0, ended: Optional[Dict[int, float]] = None) -> List[int]:
    """Each of ``procs``' (``ranks.Run`` or ``subprocess.Popen``) exit code once all have ended (``ended``:
    index -> when each was seen ended); meanwhile ``bar`` follows the steps they log together. Raises
    TimeoutExpired when ``timeout`` passes first (the caller stops those still running)."""
    deadline = time.perf_counter() + timeout
    ended = {} if ended is None else ended
    while True:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.perf_counter()
        running = [p for i, p in enumerate(procs) if i not in ended]
        bar.update(sum(steps_logged(d) for d in run_dirs) - bar.done)
        if not running:
            return [p.returncode for p in procs]
        left = deadline - time.perf_counter()
        if left <= 0:
            raise subprocess.TimeoutExpired(running[0].args, timeout)
        try:
            running[0].wait(timeout=min(poll, left))
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Job:
    """One trainer run of the check: its name, overrides (later ones win), folder, steps and rank count."""

    name: str
    overrides: Sequence[str]
    run_dir: Path
    steps: int = 0
    ranks: int = 1


ENTRY = ("-m", "megatron_recipes.train")


def _threads(job: Job, jobs: Sequence[Job]) -> Optional[int]:
    """Intra-op threads per rank: one share of the cores (runs side by side share them; a lone
    multi-rank run splits them as ``train``'s launcher does; a lone rank keeps torch's default)."""
    ranks = sum(j.ranks for j in jobs) if len(jobs) > 1 else job.ranks
    return max(1, (os.cpu_count() or 1) // ranks) if ranks > 1 else None


def train_together(jobs: Sequence[Job], recipe: str, timeout: float, progress: bool = True,
                   entry: Sequence[str] = ENTRY) -> List[RunResult]:
    """Run independent ``jobs`` side by side (``job.ranks`` ranks each, forked by runtime/ranks.py, output to
    ``<run_dir>.log``) and return their results in ``jobs``' order. One progress bar counts their steps
    together. On timeout or Ctrl-C every run still going is stopped with the process groups of its
    ranks (whatever they started too): exit 124. ``entry``: what ``python`` runs (``-m module`` or a script)."""
    start = time.perf_counter()
    procs, logs, ended_at = [], [], {}
    try:
        for job in jobs:
            job.run_dir.parent.mkdir(parents=True, exist_ok=True)
            args = [recipe, *job.overrides, f"run.dir={job.run_dir}"]
            log = job.run_dir.parent / f"{job.run_dir.name}.log"
            logs.append(log)
            log.write_text("$ " + " ".join(["python", *entry, *args]) + "\n", encoding="utf-8")
            procs.append(ranks.start(entry, args, _env(_threads(job, jobs)), str(log), job.ranks))
        total = sum(j.steps for j in jobs)
        with Progress(f"  {', '.join(j.name for j in jobs)}", total=total or None, unit="steps",
                      enabled=progress and total > 0) as bar:
            codes = wait_all(procs, [j.run_dir for j in jobs], timeout, bar, ended=ended_at)
    except BaseException:  # timeout or Ctrl-C: stop every run still going, with its ranks' process groups
        codes = []
        for i, (proc, log) in enumerate(zip(procs, logs)):
            if proc.poll() is None:
                proc.kill()
                with open(log, "a", encoding="utf-8") as out:
                    out.write(f"\n[check] stopped after {time.perf_counter() - start:.0f}s\n")
                codes.append(124)
            else:
                codes.append(proc.returncode)
            ended_at.setdefault(i, time.perf_counter())
        codes += [124] * (len(jobs) - len(codes))  # never started (Ctrl-C while starting)
    now = time.perf_counter()
    return [RunResult(j.name, c, ended_at.get(i, now) - start, j.run_dir) for i, (j, c) in enumerate(zip(jobs, codes))]
