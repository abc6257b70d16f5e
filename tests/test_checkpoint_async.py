"""Asynchronous saves (checkpoint.async_save): megatron-core's async torch_dist save on the CPU lane.

Training steps run while a save is in flight; the background checkpoint holds exactly the tensors a
synchronous save of the same state holds; a failed background write names the folder and the rank and
leaves the previous checkpoint the latest; the fork-started results queue (patch forked-write-results)
lets an entry script without a ``__main__`` guard save in the background. The model is the kill test's
~10M parameters, so a write takes long enough for steps to run beside it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow
BIG = cs.BIG


def _cfg(run_dir: str, world: int = 2):
    return cs.tiny_cfg(run_dir, world=world, extra=BIG)


def _async_and_sync(tmp: str):
    import time

    import torch

    from megatron_recipes import checkpoint as ck

    t = cs.Trainer(_cfg(str(Path(tmp) / "run")))
    t.train(1, 1)
    sync_root, async_root = Path(tmp) / "sync", Path(tmp) / "async"
    ck.save(sync_root, 1, t.model, t.optimizer, t.scheduler, {"step": 1}, t.cfg, keep_last=2)
    saves = ck.BackgroundSaves()
    trainer_pid, real_save = os.getpid(), torch.save

    def slow_in_the_writer(obj, f, *args, **kwargs):  # a slow filesystem: the write outlasts the steps below
        if os.getpid() != trainer_pid and not slow_in_the_writer.waited:
            slow_in_the_writer.waited = True
            time.sleep(8.0)
        return real_save(obj, f, *args, **kwargs)

    slow_in_the_writer.waited = False

    torch.save = slow_in_the_writer
    try:
        final = ck.save(async_root, 1, t.model, t.optimizer, t.scheduler, {"step": 1}, t.cfg, 2, background=saves)
    finally:
        torch.save = real_save  # the forked writer keeps its copy
    writer = saves.queue.async_calls[0].async_caller.process  # this rank's forked writer
    released_while_writing = writer.is_alive() and not (final / "meta.json").exists()
    beside = 0
    for step in (2, 3):  # the same steps on every rank (collectives), while the writer writes
        t.train(step, step)  # these steps change the weights the writer is writing
        beside += int(writer.exitcode is None)  # the whole step ran while this rank's writer was writing
    saves.poll()  # every rank's writer is done by now or soon: completes it, or leaves it for wait()
    saves.wait("in the test")
    return {"released": released_while_writing, "steps_beside_the_write": beside, "complete": ck.is_complete(final),
            "latest": ck.latest(async_root).name}


def _tensors(path: str):
    from megatron.core.dist_checkpointing import load_plain_tensors

    from megatron_recipes.checkpoint import restricted_loading

    with restricted_loading():
        return dict(_flat(load_plain_tensors(path)))


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def _compare(a: str, b: str):
    import torch

    from megatron_recipes.runtime.distributed import init_process_group, shutdown

    init_process_group()
    try:
        ta, tb = _tensors(a), _tensors(b)
    finally:
        shutdown()
    return {"keys": sorted(ta) == sorted(tb), "n": len(ta),
            "different": sorted(k for k in ta if k in tb and not (torch.equal(ta[k], tb[k]) if torch.is_tensor(ta[k]) else ta[k] == tb[k]))}


def test_steps_run_while_the_save_is_in_flight_and_it_equals_the_sync_one(tmp_path):
    results = run_ranks(_async_and_sync, 2, str(tmp_path))
    for r in results:
        assert r["released"] and r["steps_beside_the_write"] == 2, r
        assert r["complete"] and r["latest"] == "iter_0000001", r
    (same,) = run_ranks(_compare, 1, str(tmp_path / "sync" / "iter_0000001"), str(tmp_path / "async" / "iter_0000001"))
    assert same["keys"] and same["n"] > 20 and not same["different"], same


def _failing_write(tmp: str):
    import torch

    from megatron_recipes import checkpoint as ck
    from megatron_recipes.config.errors import RecipeError

    t = cs.Trainer(_cfg(str(Path(tmp) / "run")))
    root = ck.checkpoints_root(t.cfg)
    saves = ck.BackgroundSaves()
    ck.save(root, 1, t.model, t.optimizer, t.scheduler, {"step": 1}, t.cfg, 2, background=saves)
    saves.wait("")
    t.train(2, 2)
    trainer_pid, real_save = os.getpid(), torch.save

    def failing_in_the_writer(obj, f, *args, **kwargs):
        if torch.distributed.get_rank() == 1 and os.getpid() != trainer_pid:
            raise OSError(5, "Input/output error (injected in rank 1's writer)")
        return real_save(obj, f, *args, **kwargs)

    torch.save = failing_in_the_writer
    ck.save(root, 2, t.model, t.optimizer, t.scheduler, {"step": 2}, t.cfg, 2, background=saves)
    try:
        saves.wait("")
    except RecipeError as exc:
        return {"error": exc.message, "latest": ck.latest(root).name}
    finally:
        torch.save = real_save
    return {"error": None}


def test_a_failed_background_write_names_path_and_rank_and_keeps_the_previous_latest(tmp_path):
    results = run_ranks(_failing_write, 2, str(tmp_path))
    for r in results:
        assert r["error"] is not None, r
        assert "iter_0000002.incomplete" in r["error"] and "on rank 1" in r["error"], r["error"]
        # 0.16 passes on the writer's message; 0.19's worker failure keeps only the exception's class
        assert ("Input/output error" in r["error"] or "OSError" in r["error"]) and "iter_0000001" in r["error"], r["error"]
        assert r["latest"] == "iter_0000001"
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (root / "iter_0000002").exists()
