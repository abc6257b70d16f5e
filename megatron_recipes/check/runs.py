"""The check's training runs: each is ``python -m megatron_recipes.train`` exactly as a user starts it.

Why subprocesses of the real entry point: the proof must cover what a user runs (composition, rule table,
rank spawning, the trainer, checkpoints), not a re-creation of it. Per-step numbers come from each run's
``log.jsonl`` (also read while a run goes, for its progress bar); the full output of each run is kept next to
it (``<run>.log``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

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


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    # A rendezvous left in this environment must not leak into the ranks the trainer starts.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def steps_logged(run_dir: Path) -> int:
    """The last training step a run has logged so far (0 before its first)."""
    path = run_dir / "log.jsonl"
    try:
        return max((int(r["step"]) for r in step_records(path)), default=0) if path.is_file() else 0
    except (OSError, ValueError):  # a line being written right now: count it next time
        return 0


def wait(proc: subprocess.Popen, run_dir: Path, timeout: float, bar: Progress, poll: float = 1.0) -> int:
    """``proc``'s exit code; meanwhile ``bar`` follows the steps it logs. Raises TimeoutExpired."""
    deadline = time.perf_counter() + timeout
    while True:
        try:
            code = proc.wait(timeout=min(poll, max(0.0, deadline - time.perf_counter())))
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= deadline:
                raise
            bar.update(steps_logged(run_dir) - bar.done)
        else:
            bar.update(steps_logged(run_dir) - bar.done)
            return code


def train(name: str, recipe: str, overrides: Sequence[str], run_dir: Path, timeout: float, steps: int = 0,
          progress: bool = True) -> RunResult:
    """Run the trainer with ``overrides`` (later ones win) into ``run_dir``; output to ``<run_dir>.log``.
    While it runs, a progress bar (a line every 10 s off a terminal) counts its ``steps`` (none for 0)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd: List[str] = [sys.executable, "-m", "megatron_recipes.train", recipe, *overrides, f"run.dir={run_dir}"]
    start = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        with Progress(f"  {name}", total=steps or None, unit="steps", enabled=progress and steps > 0) as bar:
            try:
                code = wait(proc, run_dir, timeout, bar)
            except BaseException:  # timeout or Ctrl-C: stop the run's whole process group (its ranks too)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                out.write(f"\n[check] stopped after {time.perf_counter() - start:.0f}s\n")
                code = 124
    return RunResult(name, code, time.perf_counter() - start, run_dir)
