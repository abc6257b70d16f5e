"""Run a function on N local ranks (fresh processes, gloo on CPU / NCCL on GPU) and collect failures.

Conversion itself needs no process group; verification and resharding checks do, at whatever layout
the user names. Each rank is a spawned interpreter with the usual torchrun environment, so
``runtime.distributed.init_model_parallel`` works unchanged. A ``RecipeError`` raised on any rank is
re-raised here with its message; other failures name the rank.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.runtime.distributed import hosted_store


def _entry(rank: int, fn: Callable[..., None], world: int, rendezvous: Dict[str, str], status_dir: str,
           args: Sequence[Any]) -> None:
    from megatron_recipes.runtime.known_warnings import quiet

    quiet()  # counted in the command's tally
    import torch

    os.environ.update(rendezvous, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if not torch.cuda.is_available():  # CPU ranks share the cores; oversubscribed threads only slow them down
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    status = {"ok": True}
    try:
        fn(*args)
    except RecipeError as exc:
        status = {"ok": False, "recipe_error": [exc.message, exc.fix]}
        raise
    except BaseException as exc:
        status = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        raise
    finally:
        Path(status_dir, f"rank{rank}.json").write_text(json.dumps(status))


def run_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``fn(*args)`` on ``world`` spawned ranks; returns when all succeeded, raises otherwise."""
    import torch.multiprocessing as mp

    store, rendezvous = hosted_store(world)  # held here until every rank ended
    with tempfile.TemporaryDirectory(prefix="mr-ranks-") as status_dir:
        try:
            mp.start_processes(_entry, args=(fn, world, rendezvous, status_dir, args), nprocs=world,
                               start_method="spawn")
        except Exception as exc:
            for rank in range(world):
                path = Path(status_dir, f"rank{rank}.json")
                if not path.exists():
                    continue
                status = json.loads(path.read_text())
                if "recipe_error" in status:
                    message, fix = status["recipe_error"]
                    raise RecipeError(message, fix=fix) from None
                if not status["ok"]:
                    raise RuntimeError(f"rank {rank} failed: {status['error']}\n{status['traceback']}") from None
            raise RuntimeError(f"a rank died without reporting: {exc}") from None
