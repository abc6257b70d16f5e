"""Run a function on N local ranks (gloo on CPU / NCCL on GPU) and collect failures.

Conversion itself needs no process group; verification and resharding checks do, at whatever layout
the user names. Each rank is its own process with the usual torchrun environment, so
``runtime.distributed.init_model_parallel`` works unchanged. On the CPU lane the ranks fork from the
preloaded server (runtime/ranks.py), as the local launcher's do: a spawned rank paid 3-8 s of CPU importing
torch, megatron-core and transformers again, per rank. With CUDA they are fresh interpreters (a server that
imported Transformer Engine may have initialised CUDA, which a forked process could not use). A
``RecipeError`` raised on any rank is re-raised here with its message; other failures name the rank.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

from megatron_recipes.config.errors import RecipeError


def _entry(rank: int, fn: Callable[..., None], env: Dict[str, str], status_dir: str, args: Sequence[Any]) -> None:
    from megatron_recipes.runtime.ranks import fresh_signals

    fresh_signals()  # as a rank torchrun started (a forked one keeps what its server inherited)
    os.environ.clear()  # a forked rank starts with the server's environment: take the caller's and the launcher's
    os.environ.update(env)
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 1)):  # one rank: no launcher variables
        os.environ.setdefault(name, str(value))
    world = int(os.environ["WORLD_SIZE"])
    from megatron_recipes.runtime.known_warnings import quiet

    quiet()  # counted in the command's tally
    import torch

    if not torch.cuda.is_available():  # CPU ranks share the cores; oversubscribed threads only slow them down
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    status = {"ok": True}
    try:
        fn(*args)
    except RecipeError as exc:
        status = {"ok": False, "recipe_error": [exc.message, exc.fix]}
    except BaseException as exc:  # the caller says it once, with the rank's traceback
        status = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                  "at": time.time()}
    Path(status_dir, f"rank{rank}.json").write_text(json.dumps(status))
    atexit._run_exitfuncs()  # what a fresh interpreter runs at its exit (a forked rank would not)
    sys.stdout.flush()
    sys.stderr.flush()
    if not status["ok"]:
        os._exit(1)


def _context(compiles: bool):
    import multiprocessing

    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    from megatron_recipes.runtime import ranks

    return ranks.context(compiles=compiles)


def run_ranks(fn: Callable[..., None], world: int, *args: Any, compiles: bool = False) -> None:
    """``fn(*args)`` on ``world`` local ranks; returns when all succeeded, raises otherwise. ``compiles``: the
    ranks build an MoE model (as for ``runtime.ranks.context``)."""
    from megatron_recipes.runtime import ranks

    ctx = _context(compiles)
    envs, store = ranks.rank_environments(dict(os.environ), world)
    with tempfile.TemporaryDirectory(prefix="mr-ranks-") as status_dir:
        procs = [ctx.Process(target=_entry, args=(rank, fn, env, status_dir, args), name=f"rank{rank}")
                 for rank, env in enumerate(envs)]
        for proc in procs:
            proc.start()
        job = ranks.Run(procs, [fn.__name__], store)  # the first rank that fails stops the others
        if job.wait() != 0:
            _raise_cause(job, status_dir)


def _raise_cause(job, status_dir: str) -> None:
    """Say the failure that started it. Ranks that ended together are told apart by what they left: a user's
    error first; then a rank that died without reporting (a peer's end shows up in a rank as an error it
    reports, e.g. gloo's "Connection reset by peer", never as a silent death); then the earliest error."""
    statuses = {}
    for rank in job.failed_ranks:
        path = Path(status_dir, f"rank{rank}.json")
        statuses[rank] = json.loads(path.read_text()) if path.exists() else None
    for rank, status in statuses.items():
        if status and "recipe_error" in status:
            message, fix = status["recipe_error"]
            raise RecipeError(message, fix=fix) from None
    for rank, status in statuses.items():
        if status is None or status["ok"]:  # (a rank that reported success and still failed: at its exit)
            raise RuntimeError(f"rank {rank} died without reporting (exit code {job.procs[rank].exitcode})")
    rank, status = min(statuses.items(), key=lambda item: item[1].get("at", 0.0))
    raise RuntimeError(f"rank {rank} failed: {status['error']}\n{status['traceback']}") from None
