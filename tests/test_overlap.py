"""Overlapped gradient reduction and parameter all-gather train, and checkpoint, exactly like the plain path.

With ``overlap_param_gather`` the distributed optimizer updates only this rank's shard in ``step()``; the
other ranks' shards arrive in the next forward's pre-hooks. A checkpoint written between the two would
hold this rank's stale copy of them (the previous step's), unless the trainer finishes the gathers
first. Each case trains 5 steps with a checkpoint at step 3 (mid-run, no evaluation before it) with the
overlaps off and on, from the same seed and data: the per-step losses must be equal and the step-3
checkpoints (weights and optimizer state) bit-identical. DP=2, and PP=2 x VPP=2 x DP=2, where the
interleaved schedule dispatches the gathers itself (megatron-core's ``align_param_gather``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import train_support as ts

pytestmark = pytest.mark.slow

COMMON = [
    *ts.FAST,
    "train.train_iters=5",
    "checkpoint.save_interval=3",
    "checkpoint.load=none",
    "parallel=none",
    "precision=fp32",
    "optimizer.lr_warmup_iters=1",
    "optimizer.use_distributed_optimizer=true",
]
LAYOUTS = {"dp2": (2, []), "pp2_vpp2_dp2": (4, ["parallel.pp=2", "parallel.vpp=2"])}



def _run(base: Path, cache: Path, name: str, nproc: int, extra, overlap: bool) -> ts.Run:
    flags = [f"parallel.overlap_grad_reduce={str(overlap).lower()}", f"parallel.overlap_param_gather={str(overlap).lower()}"]
    run = ts.train(base / f"{name}_{overlap}", cache, *COMMON, *extra, *flags, nproc=nproc).check()
    assert len(run.series("loss")) == 5, run.output[-3000:]
    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_trains_and_checkpoints_bit_identically(tmp_path, cache, layout):
    nproc, extra = LAYOUTS[layout]
    plain, overlapped = (_run(tmp_path, cache, layout, nproc, extra, flag) for flag in (False, True))
    assert overlapped.series("loss") == plain.series("loss")
    mid = [ts.stored_tensors(r.run_dir / "checkpoints" / "iter_0000003") for r in (plain, overlapped)]
    assert any(k.startswith("optimizer.") for k in mid[0]), "the checkpoint holds no optimizer state"
    differ = ts.differing_tensors(*mid)
    assert not differ, f"step-3 checkpoints differ in {len(differ)} of {len(mid[0])} tensors: {differ[:8]}"


def _param_sync_setup(run_dir: str, vpp):
    """(rank) The trainer's DDP chunks and schedule hooks: align_param_gather and param_sync_func."""
    from checkpoint_support import tiny_cfg

    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import optim

    flags = ("parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true", "optimizer.use_distributed_optimizer=true")
    cfg = tiny_cfg(run_dir, pp=2, vpp=vpp, world=2, extra=flags)
    distributed.init_model_parallel(cfg)
    model = optim.wrap_model(cfg, build_model_chunks(cfg))
    optim.configure_schedule_hooks(cfg, model, optim.build_optimizer(cfg, model))
    funcs = model[0].config.param_sync_func
    dispatchers = [f == chunk.start_param_sync for f, chunk in zip(funcs, model)] if funcs is not None else None
    return [chunk.ddp_config.align_param_gather for chunk in model], dispatchers


@pytest.mark.parametrize("vpp", [None, 2])
def test_param_gathers_are_dispatched_once(tmp_path, vpp):
    """Under VPP the interleaved schedule dispatches each chunk's gathers (``param_sync_func``), so the
    forward pre-hooks must only wait for them: megatron-core's ``align_param_gather`` (its DDP pre-hook in
    ``distributed_data_parallel.py`` otherwise dispatches the next bucket itself, a second dispatch that
    breaks the overlap order). Without VPP the schedule never calls ``param_sync_func`` and the hooks
    dispatch; aligning there would serialise every gather."""
    from multiproc import run_ranks

    for align, dispatchers in run_ranks(_param_sync_setup, 2, str(tmp_path), vpp):
        if vpp:
            assert align == [True] * vpp and dispatchers == [True] * vpp
        else:
            assert align == [False] and dispatchers is None
