"""The local launcher's two ways to start ranks (runtime/local_launch.py), side by side in one run: torchrun's
fresh interpreters (what a machine with CUDA uses) against ranks forked from the preloaded server (the CPU
lane), each starting the same short tiny_llama_cpu run at TP=2.

    python benchmarks/local_launch.py [--launches 3] [--iters 2]

Each launch is a fresh ``python -c`` that calls one launcher, as ``megatron-recipes train`` does after
validating; reported per launch: wall seconds and the CPU seconds of the whole process tree (the launcher,
the server or torchrun's agent, the ranks), then the ratios.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def launch(launcher: str, run_dir: Path, iters: int) -> tuple:
    argv = ["tiny_llama_cpu", f"run.dir={run_dir}", f"train.train_iters={iters}", "optimizer.lr_warmup_iters=1",
            "checkpoint.save=false", f"logging.eval_interval={iters}", "logging.eval_iters=1",
            "logging.log_interval=1"]
    code = (f"import sys; from megatron_recipes.runtime.local_launch import {launcher}; "
            f"sys.exit({launcher}({argv!r}, 2, ('--module', 'megatron_recipes.train')))")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{launcher} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    results = {"torchrun_ranks": [], "forked_ranks": []}
    with tempfile.TemporaryDirectory() as tmp:
        launch("forked_ranks", Path(tmp) / "warm", args.iters)  # the data cache and the OS page cache, once
        for i in range(args.launches):
            for launcher in results:  # alternated: load drifts on a shared machine
                results[launcher].append(launch(launcher, Path(tmp) / f"{launcher}-{i}", args.iters))
    for launcher, runs in results.items():
        walls, cpus = zip(*runs)
        print(f"{launcher:>15}: {sum(walls) / len(walls):6.2f} s wall, {sum(cpus) / len(cpus):6.2f} s CPU per launch")
    (tw, tc), (fw, fc) = ([sum(x) / len(x) for x in zip(*results[k])] for k in results)
    print(f"forked / torchrun: {fw / tw:.2f} x wall, {fc / tc:.2f} x CPU")


if __name__ == "__main__":
    main()
