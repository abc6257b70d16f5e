"""Megatron-FSDP on the CPU lane never frees or uses memory of a gloo collective before waiting for it.

Why: on a GPU, Megatron-FSDP's async all-gathers and reduce-scatters keep their buffers alive stream-ordered;
the CPU lane makes streams and events no-ops while gloo writes into those buffers from a background thread
until ``Work.wait()``. A bucket released (``resize_(0)``) or read before that wait would be a use-after-free
or a silently stale value. ``inflight_check`` turns any such order into an error; its own test shows it fires.
The FSDP run is the bf16 checkpoint test's first phase (zero3, DP=2: steps 1-2, an fsdp_dtensor save, logits,
steps 3-4), where a CI run once died of glibc heap corruption.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multiproc import run_ranks

pytestmark = pytest.mark.slow


def _free_and_read_before_wait():
    """Rank side: an async all-gather whose output is read, then freed, before its wait."""
    import torch
    import torch.distributed as dist

    import inflight_check

    inflight_check.install()
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = torch.empty(4 * world)
        with inflight_check.access_mode():
            work = dist.all_gather_into_tensor(out, torch.full((4,), float(rank)), async_op=True)
            out.sum()  # a read before wait: recorded
        try:
            out.untyped_storage().resize_(0)  # a free before wait: refused
            refused = None
        except RuntimeError as exc:
            refused = str(exc)
        work.wait()
        out.untyped_storage().resize_(0)  # after wait: fine
        return {"refused": refused, "accesses": [op for op, _ in inflight_check.ACCESSES]}
    finally:
        dist.destroy_process_group()


def test_the_check_refuses_a_free_and_records_a_read_before_wait():
    for r in run_ranks(_free_and_read_before_wait, 2):
        assert r["refused"] and "not been waited for" in r["refused"] and "all_gather" in r["refused"], r
        assert any("sum" in op for op in r["accesses"]), r


def _fsdp_bf16_rank_a_checked(run_dir: str):
    import inflight_check
    import test_checkpoint_fsdp as ckpt

    inflight_check.install()
    with inflight_check.access_mode():
        out = ckpt._rank_a(run_dir, ["precision=bf16"])
    return {"violations": inflight_check.VIOLATIONS, "accesses": inflight_check.ACCESSES,
            "losses": out["losses_12"] + out["losses_34"]}


def test_fsdp_zero3_bf16_train_save_train_waits_before_every_free_and_use(tmp_path: Path):
    for r in run_ranks(_fsdp_bf16_rank_a_checked, 2, str(tmp_path), timeout=900):
        assert r["violations"] == [], r["violations"][0]
        assert r["accesses"] == [], r["accesses"][:3]
        assert len(r["losses"]) == 4 and len(set(r["losses"])) == 4, r["losses"]
