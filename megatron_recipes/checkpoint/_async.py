"""Checkpoint saves in the background: megatron-core's async torch_dist save, one save in flight at a time.

Why: a synchronous save blocks every rank for the whole write (minutes per save at 70B+). megatron-core's
``dist_checkpointing.save(..., async_sharded_save=True)`` plans and stages the tensors on the calling
ranks and returns an ``AsyncRequest``; ``AsyncCallsQueue`` forks a writer per rank (a fork is a
copy-on-write snapshot of the staged tensors, so training may change them at once) and runs the request's
finalize functions on every rank once every rank's writer has finished. Ours come last: ``meta.json``,
the rename from the staging name, the tracker, retention. So ``latest`` moves only after every rank's
write, and a write that failed (or a rank killed mid-write) leaves the previous checkpoint the latest.

The trainer polls once per step (a one-integer all-reduce, as Megatron-LM's ``maybe_finalize_async_save``)
and waits before the next save, before a preemption requeue and before it exits (the trainer counts the
seconds it spent in saves and waits, the cost async saving did not hide; each save's own line says its share).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron_recipes.checkpoint import _files as store
from megatron_recipes.checkpoint import _mcore as io
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.runtime import collectives

log = logging.getLogger(__name__)


def enabled(flag: Optional[bool]) -> bool:
    """``checkpoint.async_save``: null is on where CUDA is (clusters), off on the CPU lane."""
    return bool(torch.cuda.is_available()) if flag is None else bool(flag)


@dataclass
class InFlight:
    step: int
    staging: Path
    final: Path
    root: Path
    bytes: int  # written by all ranks together (main replicas)
    started: float
    blocked: float  # seconds the loop spent starting it


class BackgroundSaves:
    """The run's async saves. Every method is collective: every rank calls it at the same point."""

    def __init__(self) -> None:
        self.queue = None
        self.inflight: Optional[InFlight] = None
        self.finished = 0

    def _queue(self):
        if self.queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue(persistent=False)  # a fresh writer per save: no resident worker
        return self.queue

    def schedule(self, request, step: int, root: Path, local_bytes: int, began: float, finish: Callable[[], Any]) -> None:
        """Start ``request``'s write (forks the writers); ``finish`` runs on every rank after all wrote."""
        request.add_finalize_fn(finish)
        self._queue().schedule_async_request(request)
        total = int(collectives.all_reduce_values([local_bytes], op="sum")[0])
        blocked = time.perf_counter() - began
        self.inflight = InFlight(step, store.staging_dir(root, step), store.iter_dir(root, step), root, total,
                                 time.perf_counter(), blocked)
        _say(f"checkpoint save started: step {step} -> {self.inflight.final} ({total / 2**20:.1f} MiB from all ranks, "
             f"in the background; the loop was blocked {blocked:.2f} s to stage it)")

    def poll(self) -> Optional[Path]:
        """Finish the save in flight if every rank's write is done (never waits); its folder, or None."""
        return self._finalize(blocking=False, why="")

    def wait(self, why: str) -> Optional[Path]:
        """Block until the save in flight is complete (or has failed: RecipeError naming path and rank)."""
        return self._finalize(blocking=True, why=why)

    def _finalize(self, blocking: bool, why: str) -> Optional[Path]:
        job = self.inflight
        if job is None:
            return None
        began = time.perf_counter()
        if blocking and why:
            _say(f"waiting for the checkpoint in flight (step {job.step}) {why}")
        try:
            done = self._queue().maybe_finalize_async_calls(blocking=blocking)
        except BaseException as exc:  # noqa: B902 - torch DCP's CheckpointException is a BaseException
            self.inflight = None
            raise _failed(job, exc) from None
        waited = time.perf_counter() - began
        if not done:
            return None
        self.inflight, self.finished = None, self.finished + 1
        _say(f"checkpoint save finished: {job.final} ({job.bytes / 2**20:.1f} MiB) after "
             f"{time.perf_counter() - job.started:.2f} s in the background; the loop was blocked "
             f"{job.blocked + waited:.2f} s for it")
        return job.final

    def abort(self) -> None:
        """After an error (no collectives: other ranks may be gone): a write still running is killed, so its
        staging folder stays incomplete and the previous checkpoint the latest."""
        if self.queue is not None:
            if self.inflight is not None:
                log.warning("abandoning the checkpoint in flight (step %s): the run stopped with an error", self.inflight.step)
            for call in list(self.queue.async_calls):  # close(abort=True) kills only a persistent worker
                call.async_caller.close(abort=True)
            self.queue.async_calls.clear()
            self.queue, self.inflight = None, None


def _say(text: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(text, flush=True)
    log.info(text)


def _failed(job: InFlight, exc: BaseException) -> RecipeError:
    """One message on every rank: which folder, which rank's write, why; what stays the latest."""
    failures = getattr(exc, "failures", None) or {}
    ranks = sorted({r for rank_list in collectives.all_gather_object(sorted(failures)) for r in rank_list or []})
    cause = exc.message if isinstance(exc, RecipeError) else io.root_cause(exc)
    causes = [c for c in collectives.all_gather_object(cause if failures or isinstance(exc, RecipeError) else "") if c]
    last = store.latest(job.root)
    where = f"on rank {', '.join(map(str, ranks))}" if ranks else "on some rank"
    error = RecipeError(
        f"the background write of checkpoint {job.staging} failed {where} ({causes[0] if causes else cause}); "
        f"the latest checkpoint stays {last if last is not None else 'none (no checkpoint was completed yet)'}",
        fix="check that rank's log and the filesystem (space, permissions), then start the run again: it resumes "
        "from the latest checkpoint; checkpoint.async_save=false writes in the foreground",
    )
    error.__cause__ = exc if isinstance(exc, Exception) else None
    return error
