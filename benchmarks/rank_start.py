"""Start cost of a test rank (``tests/multiproc.run_ranks``): a fresh ``spawn`` interpreter per rank
against ranks forked from the session's preloaded ``forkserver``, measured side by side in one run.

    python benchmarks/rank_start.py [--launches 4] [--world 2]

Each launch runs a rank function that imports what a training test's rank imports; it reports wall
seconds per launch and the CPU seconds each rank process spent (its own ``getrusage``: the imports a
spawned rank pays, and a forked rank does not). The forkserver's one-time preload is reported apart.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import multiproc  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def rank_imports() -> float:
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    import megatron_recipes.training.loop  # noqa: F401

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(kind: str, launches: int, world: int) -> tuple:
    multiproc._context = (lambda: mp.get_context("spawn")) if kind == "spawn" else _forkserver
    walls, cpus = [], []
    for _ in range(launches):
        start = time.perf_counter()
        cpus += multiproc.run_ranks(rank_imports, world)
        walls.append(time.perf_counter() - start)
    return walls, cpus


_forkserver = multiproc._context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    multiproc.run_ranks(rank_imports, 1)  # starts the forkserver (its preload is paid once per session)
    print(f"forkserver start + preload + first rank: {time.perf_counter() - start:.1f} s wall")
    for kind in ("spawn", "forkserver", "spawn", "forkserver"):  # alternated: load drifts on a shared machine
        walls, cpus = measure(kind, args.launches, args.world)
        print(f"{kind:>10}: {sum(walls) / len(walls):6.2f} s wall per {args.world}-rank launch, "
              f"{sum(cpus) / len(cpus):5.2f} s CPU per rank process")


if __name__ == "__main__":
    main()
