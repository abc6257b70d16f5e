"""Run a function on N gloo ranks as real processes and collect what each rank returns.

Why: multi-rank tests must exercise real process groups (megatron-core collectives, checkpoint writers
that fork), and a failing or hung rank must fail the test with that rank's traceback instead of hanging
CI. Each rank is a fresh process with the test process's environment as it is at the call (plus ``env``
and RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT), one intra-op thread (CI machines have few
cores), and its process group torn down at exit.

Ranks are forked from the one server per test process that ``check`` forks its ranks from
(``megatron_recipes.runtime.ranks``, preloading ``training/rank_preload.py``: ``patches.apply("process")`` then torch,
megatron-core and the training stack, as the entry points do): a fresh interpreter per rank paid those
imports (~5 s of CPU) ~200 times per suite. The trainer runs of ``train_support`` fork from the same
server. Nothing else is shared: each rank is still its own process, started from the same clean,
just-imported state (tests/test_multiproc.py looks for traces one rank could leave to the next).

    results = run_ranks(my_rank_fn, 2, arg1, arg2)   # [rank0_result, rank1_result]

A rank that dies natively (a glibc heap-check abort, a segfault) fails with its exit code and the Python
stack of each of its threads at that moment (``faulthandler``), so a rare crash in CI says where it was.

``my_rank_fn`` must be a module-level function (spawn pickles it by name) and return picklable values.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron_recipes.runtime.distributed import hosted_store


class RankFailed(AssertionError):
    """A rank raised, died, or did not finish in time."""


_FAULT_FILE = None  # this rank's faulthandler file (kept open for the process's life)


def _context():
    """The test process's forkserver context: check's server (it starts at the first rank and serves every
    later one, the trainer runs' ranks included). The session's ranks fine-tune with Hugging Face tokenizers and
    build MoE models: the server imports what those load, once, instead of each such rank."""
    from megatron_recipes.runtime import ranks

    return ranks.context(tokenizers=True, compiles=True)


def _reseed_numpy() -> None:
    import sys

    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _rank_entry(
    fn, rank: int, world: int, rendezvous: Dict[str, str], caller_env: Dict[str, str], env: Dict[str, str], args: tuple,
    results,
    fault_path: str = "",
) -> None:
    if fault_path:  # a native crash (abort, segfault) leaves every thread's Python stack here for the parent
        global _FAULT_FILE
        _FAULT_FILE = open(fault_path, "w")  # noqa: SIM115 (open until the process ends)
        faulthandler.enable(file=_FAULT_FILE, all_threads=True)
    gc.freeze()  # as runtime/ranks' ranks: what the server preloaded stays out of this rank's garbage collections
    os.environ.clear()  # the forkserver's environment is the one of its start: take the caller's, now
    os.environ.update(caller_env)
    os.environ.update(rendezvous, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(env)
    torch.set_num_threads(1)
    torch.seed()  # a fresh interpreter's generators are seeded from OS entropy; forked ones share the server's
    _reseed_numpy()
    try:
        from megatron_recipes.runtime import patches

        patches.apply("process")  # as the entry points do, before the rank imports megatron-core
        value = fn(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: torch's queue would share tensors via fds that die with the rank
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # reported to the parent with the traceback, which fails the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron_recipes.runtime import distributed

            distributed.shutdown()
        except Exception:
            pass


def _fault_report(rank: int, path: str) -> str:
    """What faulthandler wrote when the rank died natively (glibc abort, segfault): where each thread was."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\nrank {rank} native crash, Python stacks of its threads:\n{text}" if text else ""


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, env: Optional[Dict[str, str]] = None
) -> List[Any]:
    """``fn(*args)`` on ``world_size`` ranks; per-rank return values, or RankFailed naming the rank."""
    ctx = _context()
    results = ctx.Queue()
    store, rendezvous = hosted_store(world_size)  # the ranks' rendezvous, held here until they end
    faults = tempfile.TemporaryDirectory(prefix="ranks-")
    fault_paths = [os.path.join(faults.name, f"rank{rank}.fault") for rank in range(world_size)]
    procs = [
        # Not daemonic: megatron-core's checkpoint writer forks worker processes from each rank.
        ctx.Process(target=_rank_entry, args=(fn, rank, world_size, rendezvous, dict(os.environ), dict(env or {}), args,
                                              results, fault_paths[rank]))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode is not None]
                if dead:
                    time.sleep(1.0)  # its result may still be in flight
                    if results.empty():
                        codes = [procs[r].exitcode for r in dead]
                        raise RankFailed(f"rank(s) {dead} exited (codes {codes}) without a result"
                                         + "".join(_fault_report(r, fault_paths[r]) for r in dead))
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in outputs]
                    raise RankFailed(f"rank(s) {missing} did not finish within {timeout:.0f}s")
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=30 if len(outputs) == world_size else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
        faults.cleanup()
    return [outputs[r] for r in range(world_size)]
