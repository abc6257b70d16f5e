"""Model-state memory, pipeline schedule arithmetic and the step-time model, against independent sources:
megatron-core's own schedule function and the sharding rules (the FLOP identity: test_cost_model.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate import schedule
from megatron_recipes.estimate.memory import estimate_memory, model_state_bytes, stage_memory
from megatron_recipes.estimate.params import model_params, stage_params
from megatron_recipes.estimate.steptime import estimate_step_time


def _pp_rank_microbatches(cfg, rank):
    """megatron-core's warm-up count for this rank (duck-typed communicator, no process group)."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    p = cfg.parallel
    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: p.pp, rank=lambda: rank), virtual_pipeline_model_parallel_size=p.vpp
    )
    total, all_warmup, warmup, _ = get_pp_rank_microbatches(
        derived.num_microbatches(cfg), derived.virtual_pipeline_size(cfg), p.pp, p2p_communicator=comm
    )
    return total if all_warmup else warmup + 1


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # pp4 vpp5, 64 microbatches
        ["parallel.vpp=null"],
        ["parallel.vpp=2", "train.global_batch_size=8"],  # few microbatches
        ["parallel.pp=8", "parallel.vpp=null", "parallel.cp=1", "train.global_batch_size=16"],
    ],
)
def test_in_flight_microbatches_match_megatron_schedule(overrides):
    cfg = compose_recipe("llama3_70b_pretrain", overrides)
    for rank in range(cfg.parallel.pp):
        assert schedule.chunk_microbatches_in_flight(cfg, rank) == _pp_rank_microbatches(cfg, rank), rank


def test_bubble_fraction_formula_and_interleaving():
    plain = compose_recipe("llama3_70b_pretrain", ["parallel.vpp=null"])
    m, pp = derived.num_microbatches(plain), plain.parallel.pp
    assert schedule.bubble_fraction(plain) == pytest.approx((pp - 1) / (m + pp - 1))
    interleaved = compose_recipe("llama3_70b_pretrain")
    assert schedule.bubble_fraction(interleaved) < schedule.bubble_fraction(plain) / 4


def test_distributed_optimizer_shards_dense_over_dp_cp_and_experts_over_expert_dp():
    cfg = compose_recipe("mixtral_8x7b_pretrain")
    params = stage_params(cfg, 0)
    assert params.expert > 0 and params.dense > 0
    weights, grads, opt = model_state_bytes(cfg, params)
    dp_cp = derived.data_parallel_size(cfg) * cfg.parallel.cp
    edp = derived.expert_data_parallel_size(cfg)
    assert edp != dp_cp  # the two groups differ here, so the test can tell them apart
    assert (weights, grads) == (2 * params.total, 4 * params.total)  # bf16 weights, fp32 main grads
    assert opt == pytest.approx(12 * (params.dense / dp_cp + params.expert / edp))
    plain = compose_recipe("mixtral_8x7b_pretrain", ["optimizer.use_distributed_optimizer=false", "parallel.overlap_param_gather=false"])
    assert model_state_bytes(plain, params)[2] == 12 * params.total


@pytest.mark.parametrize(
    "overrides,per_param",
    [
        (["precision=fp32"], 8),  # Adam moments only: fp32 params are their own master copy
        (["optimizer=sgd", "optimizer.sgd_momentum=0.9"], 8),  # fp32 master + momentum
        (["optimizer=sgd"], 4),  # fp32 master only
    ],
)
def test_optimizer_state_per_parameter(overrides, per_param):
    cfg = compose_recipe("llama3_70b_pretrain", overrides + ["optimizer.use_distributed_optimizer=false", "parallel.overlap_param_gather=false"])
    params = stage_params(cfg, 0)
    assert model_state_bytes(cfg, params)[2] == per_param * params.total


def test_peft_freezes_base_model_state():
    cfg = compose_recipe("llama3_70b_pretrain", ["peft.method=lora", "checkpoint.pretrained=base"])
    full = compose_recipe("llama3_70b_pretrain")
    frozen, trained = stage_memory(cfg, 0), stage_memory(full, 0)
    assert frozen.grads == 0 and frozen.optimizer == 0 and frozen.weights == trained.weights


def test_verdict_and_stage_totals_are_consistent():
    est = estimate_memory(compose_recipe("llama3_70b_pretrain"))
    assert est.fits and est.margin == pytest.approx(est.capacity - max(s.total for s in est.stages))
    first, last = est.stages[0], est.stages[-1]
    assert first.in_flight > last.in_flight  # the first stage holds the most microbatches
    assert sum(stage_params(compose_recipe("llama3_70b_pretrain"), r).total for r in range(4)) * 4 == pytest.approx(
        model_params(compose_recipe("llama3_70b_pretrain")).total, rel=0.002
    )  # 4 stages x TP4 hold the model once (padded vocab differs slightly)


def test_step_time_model_properties():
    base = compose_recipe("llama3_70b_pretrain")
    st = estimate_step_time(base)
    assert 0 < st.mfu < 1 and st.total == pytest.approx(sum(st.breakdown().values()))
    # TP spread over two nodes (explicitly allowed) pays network bandwidth: slower than TP inside a node
    inter = compose_recipe("llama3_70b_pretrain", ["parallel.tp=16", "parallel.allow_inter_node_tp=true", "model.num_query_groups=16",
                                                   "parallel.pp=2", "parallel.vpp=null", "parallel.cp=1", "cluster.nodes=4"])
    intra = compose_recipe("llama3_70b_pretrain", ["parallel.tp=8", "model.num_query_groups=16", "parallel.pp=4",
                                                   "parallel.vpp=null", "parallel.cp=1", "cluster.nodes=4"])
    assert estimate_step_time(inter).tp > 5 * estimate_step_time(intra).tp
    # interleaving shrinks the bubble; full recompute costs compute
    assert st.bubble < estimate_step_time(compose_recipe("llama3_70b_pretrain", ["parallel.vpp=null"])).bubble
    recompute = estimate_step_time(compose_recipe("llama3_70b_pretrain", ["train.recompute=full"]))
    assert recompute.compute == pytest.approx(st.compute * 4 / 3, rel=0.02)
