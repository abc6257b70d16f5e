"""Wall and CPU time of ``megatron-recipes check`` on a recipe, optionally next to another checkout's.

    python benchmarks/check_wall.py tiny_llama_cpu [overrides ...] [--repeat 2] [--base DIR]

Each repeat runs ``python -m megatron_recipes.cli check <recipe> [overrides]`` in a fresh folder; with
``--base`` (a checkout of another commit, e.g. ``git archive main | tar -x -C DIR``) it alternates that
checkout's check (put first on PYTHONPATH) with this one's, so both see the same machine load. CPU is
every process's user+system time, the check's ranks included: this process becomes a child subreaper
(Linux ``prctl``), so the processes that outlive their parent (the check's fork server and what it forks)
are reaped here and counted too. The 1-minute load average at each start is printed beside the times:
on a shared machine only side-by-side ratios mean much.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_all() -> None:
    """Wait for every descendant re-parented here (the check's fork server exits after the check)."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def measure(recipe: str, overrides, base: str, env: dict) -> tuple:
    env = dict(env)
    if base:
        env["PYTHONPATH"] = os.pathsep.join([base, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    with tempfile.TemporaryDirectory(prefix="check_wall_") as tmp:
        cmd = [sys.executable, "-m", "megatron_recipes.cli", "check", recipe, *overrides, "--dir", str(Path(tmp) / "check")]
        load = os.getloadavg()[0]
        cpu0, start = _children_cpu(), time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        wall = time.perf_counter() - start
        _reap_all()
        cpu = _children_cpu() - cpu0
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    return wall, cpu, load, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--base", default="", help="another checkout to run side by side (first on PYTHONPATH)")
    args = parser.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed: CPU of orphaned ranks would not be counted")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    kinds = [("base", args.base), ("this", "")] if args.base else [("this", "")]
    for i in range(args.repeat):
        for name, base in kinds:
            wall, cpu, load, code = measure(args.recipe, args.overrides, base, env)
            print(f"{args.recipe} [{name}] run {i + 1}: {wall:6.1f} s wall, {cpu:6.1f} s CPU, exit {code}, "
                  f"load {load:.2f}", flush=True)


if __name__ == "__main__":
    main()
