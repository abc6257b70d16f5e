"""Rows of scopes ``fsdp`` and ``save``/``async_save``: Megatron-FSDP's unsharded gradient reduction and
the checkpoint writer's results queue.

Each ``_fix`` / ``_defect`` pair is one row of the table in ``runtime/patches/__init__.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import queue
from typing import Any, Iterator, List

import torch

from megatron_recipes.runtime import mcore_compat


# --- fsdp: Megatron-FSDP's reduction of an unsharded gradient buffer -----------------------------

_UNSHARDED = "_megatron_recipes_unsharded_grad_reduce"


def _reduce_unsharded_grads_once() -> None:
    """Megatron-FSDP's hook-driven reduction of an *unsharded* gradient buffer (zero1 at any DP size; every
    mode at DP=1, where nothing is sharded) reads the bucket that *is* that buffer, reduces it into a fresh
    tensor and adds the result back (``local_grad += reduced_grad``, meant for a sharded buffer's separate
    bucket): each reduction doubles the accumulated gradients at DP=1 (x2 with one micro-batch; under zero2/zero3,
    which reduce every micro-batch, buf = 2 * (buf + g)), and at DP>1 zero1 gets its own gradient plus the sum
    (and, with ``overlap_grad_reduce=False``, a second reduction in ``finish_grad_sync``: x2). For unsharded buffers
    this makes the reduction happen once per step and replace this rank's shard:

    * one-rank group: a sum over one rank is the buffer itself: bookkeeping only;
    * ``overlap_grad_reduce=False``: ``finish_grad_sync`` reduce-scatters the buffer in place: bookkeeping only;
    * otherwise: reduce-scatter into a fresh tensor (synchronously) and copy it into this rank's shard.

    Sharded buffers, outer-DP (HSDP) reduction and one-rank groups with a scaling factor other than 1 (not
    per-token loss) stay megatron-core's."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    original = pgb.GradReducePipeline._bucket_group_gradient_reduce
    if getattr(original, _UNSHARDED, False):
        return

    def bucket_group_gradient_reduce(self, bucket_group, async_op=False, outer_fsdp_group_grad_reduce=False):
        buffers = [self.get_fsdp_buffer(b) for b in bucket_group]
        one_rank = all(b.data_parallel_group.size() == 1 for b in buffers)
        if (
            outer_fsdp_group_grad_reduce
            or any(b.is_data_distributed for b in buffers)
            or (one_rank and any(b.gradient_scaling_factor not in (None, 1.0) for b in buffers))
        ):
            return original(self, bucket_group, async_op=async_op, outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce)
        if not one_rank and self.buffer.ddp_config.overlap_grad_reduce:
            from megatron_recipes.runtime import collectives

            for gbuf in buffers:
                bucket = gbuf.fetch_bucket()  # a view of the whole unsharded buffer
                op = pgb.gradient_reduce_preprocessing(bucket.data, gbuf.gradient_scaling_factor, gbuf.ddp_config)
                reduced = torch.empty_like(gbuf.get_shard_from_bucket(bucket))
                collectives.reduce_scatter_tensor(reduced, bucket.data, op=op, group=gbuf.data_parallel_group)
                gbuf.get_shard_from_local_buffer().copy_(reduced)
        for bucket_id in bucket_group:  # what megatron-core's free-up step does for an unsharded buffer
            self.bucket_grad_ready_params[bucket_id] = set()
            self.bucket_status[bucket_id] = pgb.BucketStatus.EMPTY
        return True

    setattr(bucket_group_gradient_reduce, _UNSHARDED, True)
    pgb.GradReducePipeline._bucket_group_gradient_reduce = bucket_group_gradient_reduce


def _unsharded_grad_reduce_adds_back() -> bool:
    """Reads the source (the defect shows only across two ranks): the accumulation line is in 0.16's method
    and in 0.17's rewrite of it. The behaviour is ``tests/test_fsdp_gradients.py``: on 0.19.2 without this
    row one rank is right but zero1 at DP=2 without overlap_grad_reduce logs grad norm 11.57 against DDP's 7.44."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    method = pgb.GradReducePipeline._bucket_group_gradient_reduce
    source = inspect.getsource(method)
    # 0.16's accumulation line, run for sharded and unsharded buffers alike
    return not getattr(method, _UNSHARDED, False) and "local_grad += reduced_grad" in source


# --- save: the checkpoint writer's results queue -------------------------------------------------


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """For one synchronous save, an in-process results queue instead of megatron-core's spawn Manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        import logging

        logging.getLogger(__name__).warning(
            "this megatron-core's checkpoint writer has no _results_queue slot; its own multiprocessing queue "
            "is used, so the entry script needs an `if __name__ == \"__main__\":` guard"
        )
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _writer_starts_a_spawn_manager() -> bool:
    """Asked for its results queue, the writer starts a ``multiprocessing`` Manager process (its queue is a
    proxy to it); the Manager started here is shut down again and the writer's slot left as found."""
    from multiprocessing.managers import BaseProxy

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:  # a queue is already there: nothing gets started
        return isinstance(filesystem_async._results_queue, BaseProxy)
    made = mcore_compat.write_results_queue_getter()()
    filesystem_async._results_queue = None
    manager = getattr(made, "_manager", None)
    if manager is not None:
        manager.shutdown()
    return isinstance(made, BaseProxy)


_FORK_MANAGER: List[Any] = []  # [manager, queue]: one per process, started on the first async save


@contextlib.contextmanager
def _forked_write_results() -> Iterator[None]:
    """For an async save: a results queue served by a *fork*-started Manager (the write runs in another
    process, so the queue must cross processes; a fork child does not re-import the entry script)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not _FORK_MANAGER:
        manager = multiprocessing.get_context("fork").Manager()
        queue_ = manager.Queue()
        queue_._megatron_recipes_fork = True
        _FORK_MANAGER.extend([manager, queue_])
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = _FORK_MANAGER[1]
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def _async_writer_starts_a_spawn_manager() -> bool:
    """The queue an async save would get is a spawn-started Manager's (ours is marked as fork-started)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    slot = filesystem_async._results_queue
    if slot is not None:
        return not getattr(slot, "_megatron_recipes_fork", False)
    return _writer_starts_a_spawn_manager()
