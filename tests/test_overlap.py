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


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


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
