"""The EP all-to-all in the step-time model (estimate/moe_comm.py): what the combined 1F1B schedule can
hide, bounded by the computation beside it, and what the dispatchers move over which link."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate import moe_comm, rates
from megatron_recipes.estimate.groups import build_group_map
from megatron_recipes.estimate.steptime import estimate_step_time

QWEN = "qwen3_235b_a22b_pretrain"  # TP2 PP8 VPP4 EP32 on H100, all-to-all overlapped


def _no_overlap(*extra):
    return compose_recipe(QWEN, ["parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false", *extra])


@pytest.mark.parametrize("attn,mlp,transfer", list(itertools.product((0.0, 0.3, 1.0), (0.0, 0.5, 2.0), (0.0, 0.2, 1.0, 5.0))))
@pytest.mark.parametrize("delay", [False, True])
def test_combined_layer_is_bounded_by_its_streams(attn, mlp, transfer, delay):
    """A layer pair never beats either stream's own work, and never takes longer than doing all in turn."""
    sides = moe_comm.LayerSides(attn, mlp)
    t = moe_comm.combined_layer_time(sides, transfer, delay)
    assert max(sides.pair, 4 * transfer) - 1e-12 <= t <= sides.pair + 4 * transfer + 1e-12


def test_combined_layer_hides_all_when_compute_dominates_and_nothing_when_it_is_absent():
    sides = moe_comm.LayerSides(attn=1.0, mlp=1.0)
    assert moe_comm.combined_layer_time(sides, 0.0, True) == pytest.approx(sides.pair)
    assert moe_comm.combined_layer_time(sides, 0.1, True) == pytest.approx(sides.pair)  # each transfer hidden
    assert moe_comm.combined_layer_time(moe_comm.LayerSides(0.0, 0.0), 0.5, True) == pytest.approx(2.0)


def test_delayed_weight_gradients_fill_the_backward_dispatch():
    """Without delay_wgrad_compute the backward dispatch waits for the experts' weight gradients: a transfer
    longer than the input-gradient pass but shorter than both passes starts later and delays the attention
    backward (attention 1 + MLP 1 forward, transfers 1.4: the delayed run 6.4, the other 6.8)."""
    sides = moe_comm.LayerSides(attn=1.0, mlp=1.0)
    with_delay = moe_comm.combined_layer_time(sides, 1.4, True)
    without = moe_comm.combined_layer_time(sides, 1.4, False)
    assert (with_delay, without) == (pytest.approx(6.4), pytest.approx(6.8))
    for transfer in (0.0, 0.3, 1.0, 3.0):
        assert moe_comm.combined_layer_time(sides, transfer, True) <= moe_comm.combined_layer_time(sides, transfer, False)


def test_warmup_forwards_run_alone_as_megatron_schedules_them():
    """The unpaired share is megatron-core's warm-up count with the overlap's extra forward."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    cfg = compose_recipe(QWEN)
    p = cfg.parallel
    for rank in range(p.pp):
        comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: p.pp, rank=lambda r=rank: r),
                               virtual_pipeline_model_parallel_size=p.vpp)
        total, _, warmup, _ = get_pp_rank_microbatches(derived.num_microbatches(cfg), p.vpp, p.pp,
                                                       overlap_moe_expert_parallel_comm=True, p2p_communicator=comm)
        assert moe_comm.unpaired_share(cfg, rank) == pytest.approx(warmup / total)


def test_overlap_holds_one_more_chunk_microbatch_in_flight():
    """Memory: megatron-core's warm-up with the overlap's extra forward, plus the one in steady state."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from megatron_recipes.estimate import schedule

    cfg = compose_recipe(QWEN)
    p = cfg.parallel
    for rank in range(p.pp):
        comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: p.pp, rank=lambda r=rank: r),
                               virtual_pipeline_model_parallel_size=p.vpp)
        _, _, warmup, _ = get_pp_rank_microbatches(derived.num_microbatches(cfg), p.vpp, p.pp,
                                                   overlap_moe_expert_parallel_comm=True, p2p_communicator=comm)
        assert schedule.chunk_microbatches_in_flight(cfg, rank) == warmup + 1
        assert schedule.chunk_microbatches_in_flight(_no_overlap(), rank) == warmup


def test_overlap_hides_traffic_but_never_more_than_the_computation_beside_it():
    on, off = estimate_step_time(compose_recipe(QWEN)), estimate_step_time(_no_overlap())
    assert on.ep_blocking == pytest.approx(off.ep) and off.ep_hidden == off.ep_transfer == 0.0
    assert 0 < on.ep_hidden <= on.ep_transfer  # only the transfers hide, at most all of them...
    assert on.ep_hidden <= on.compute + on.tp  # ...and at most the computation beside them
    assert on.ep < off.ep and on.total < off.total


def test_comm_bound_layers_expose_what_exceeds_the_computation():
    """The published H100 run is comm-bound: its transfers outgrow the computation, which hides nearly all it
    can; on a network four times faster the computation hides them all but the unpaired warm-up."""
    st = estimate_step_time(compose_recipe(QWEN))
    assert st.ep_transfer > st.compute + st.tp
    assert st.ep >= st.ep_transfer - (st.compute + st.tp) - 1e-9
    fast = estimate_step_time(compose_recipe(QWEN, ["cluster.inter_node_bw_gbps=200"]))
    assert fast.ep_transfer < fast.compute and fast.ep_hidden > 0.9 * fast.ep_transfer


def test_blocking_and_overlapped_exchanges_move_the_same_volume_at_their_rates():
    """EP8 inside an 8-GPU node: alltoall moves k x 7/8 of each token's copies over NVLink; a blocking exchange
    at the calibrated figure, an overlapped transfer at the collectives' link efficiency."""
    cfg = compose_recipe(QWEN, ["parallel.tp=1", "parallel.sp=false", "parallel.ep=8", "parallel.pp=8", "parallel.vpp=null",
                                "parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false"])
    groups = build_group_map(cfg)
    assert groups["ep"].intra_nvlink
    tokens, h = 4096, 4096
    link = 4 * 8 * 7 / 8 * tokens * h * 2 / (cfg.cluster.intra_node_bw_gbps * 1e9)
    assert moe_comm.blocking_time(cfg, groups, tokens, 2) == pytest.approx(link / rates.ALL_TO_ALL_EFFICIENCY)
    assert moe_comm.transfer_time(cfg, groups, tokens, 2) == pytest.approx(link / rates.LINK_EFFICIENCY)
