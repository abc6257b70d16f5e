"""The planner against published measurements: every DGX-H100 row of a family we ship must plan as FITS,
pass every rule, and estimate tokens/s/GPU within +/-20% of what NVIDIA measured (the rows the constants
in estimate/rates.py were calibrated on). Other systems' rows are reported by
benchmarks/published_throughput.py, not asserted: they check the model, they do not tune it."""

from __future__ import annotations

import pytest

from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate.memory import estimate_memory
from megatron_recipes.estimate.steptime import estimate_step_time
from megatron_recipes.plan.search import search_layouts
from megatron_recipes.validation.validate import validate
from tests import published_support as pub

H100 = [r for r in pub.load() if r.system == "DGX-H100"]


def _cfg(row: pub.Row):
    base = compose_recipe(pub.RECIPES[row.model], [])
    overrides, why = pub.overrides(row, base.model.num_layers)
    assert overrides is not None, why
    return compose_recipe(pub.RECIPES[row.model], overrides)


def test_table_has_the_issue_rows():
    models = {r.model for r in H100}
    assert {"LLAMA3_70B", "LLAMA3.1_405B", "Qwen3_30B_a3B", "Qwen3_235B_a22B"} <= models
    assert all(r.model in pub.RECIPES for r in pub.load())
    assert all((r.system, r.model) in pub.RUNS for r in pub.load() if r.ep)  # every MoE run says its dispatcher


@pytest.mark.parametrize("row", [r for r in pub.load() if r.model in ("DeepSeekV3", "Qwen3_235B_a22B")], ids=lambda r: r.label)
def test_model_flops_per_token_match_the_published_mfu_count(row):
    """Our FLOPs per token (the MFU numerator) against the table's model TFLOP/s over its tokens/s: Megatron-Bridge
    counts the same routed experts, MLA, padded logits and DeepSeek-V3's MTP layer with its own logits (3.7% of
    its count). Both published figures are rounded (tokens/s to tens, a few % on the dense rows' small ones)."""
    from megatron_recipes.estimate import cost

    published = row.model_tflops_per_gpu * 1e12 / row.tokens_per_s_per_gpu
    assert cost.flops_per_token(_cfg(row)) == pytest.approx(published, rel=0.01)


def test_deepseek_rows_plan_with_the_published_layouts():
    """61 layers + MTP split over pp x vp only with a pipeline layout: each DeepSeek-V3 row gets Bridge's, which
    passes every layout rule and places the MTP layer and the loss on the last rank's last chunk."""
    rows = [r for r in pub.load() if r.model == "DeepSeekV3"]
    assert {r.system for r in rows} >= {"DGX-GB300", "DGX-GB200", "DGX-B200"}
    for row in rows:
        cfg = _cfg(row)
        assert cfg.parallel.pipeline_layout == pub.LAYOUTS[(row.model, row.pp, row.vp)]
        assert [v.rule_id for v in validate(cfg) if v.rule_id != "memory.fits"] == [], row.label
        assert derived.mtp_stage(cfg) == (row.pp - 1, max(1, row.vp) - 1)
        assert sum(len(c) for stage in derived.pipeline_stage_layers(cfg) for c in stage) == 61


def test_deepseek_rows_recompute_the_published_modules_and_fit():
    """Each published DeepSeek-V3 run recomputes modules (Megatron-Bridge's recompute_modules: MLA up-projections,
    dense MLPs): its row plans with them, fits its GPUs, and would not without them (memory is what they buy)."""
    rows = [r for r in pub.load() if r.model == "DeepSeekV3"]
    for row in rows:
        cfg = _cfg(row)
        assert cfg.train.recompute == "selective" and tuple(cfg.train.recompute_modules) == pub.RUNS[(row.system, row.model)].recompute
        assert [v.rule_id for v in validate(cfg)] == [], row.label
        assert estimate_memory(cfg).fits, row.label
        assert not any("recompute" in note for note in pub.unmodelled(row)), row.label
    plain = [estimate_memory(compose_recipe(pub.RECIPES[r.model], pub.overrides(r, 61)[0] + ["train.recompute=none",
             "train.recompute_modules=[core_attn]"])).fits for r in rows]
    assert not all(plain)


def test_moe_rows_take_their_runs_dispatcher_and_overlap():
    h100 = next(r for r in H100 if r.model == "Qwen3_235B_a22B")
    cfg = _cfg(h100)
    assert (cfg.parallel.moe_dispatcher, cfg.parallel.overlap_moe_expert_parallel_comm, cfg.parallel.delay_wgrad_compute) == (
        "alltoall", True, True)
    b200 = next(r for r in pub.load() if r.model == "DeepSeekV3" and r.system == "DGX-B200")
    assert (_cfg(b200).parallel.moe_flex_backend, _cfg(b200).parallel.overlap_moe_expert_parallel_comm) == ("deepep", True)
    qwen30 = next(r for r in H100 if r.model == "Qwen3_30B_a3B")
    assert (_cfg(qwen30).parallel.moe_dispatcher, _cfg(qwen30).parallel.overlap_moe_expert_parallel_comm) == ("flex", False)


def test_qwen3_235b_h100_run_hides_its_all_to_all():
    """The published H100 run overlaps its EP all-to-all (32 ranks over 4 nodes): the other micro-batch's
    computation hides part of its transfers, and the plan without the overlap is slower."""
    row = next(r for r in H100 if r.model == "Qwen3_235B_a22B")
    st = estimate_step_time(_cfg(row))
    assert 0 < st.ep_hidden < st.ep_transfer and st.ep < st.ep_blocking
    off = estimate_step_time(compose_recipe(pub.RECIPES[row.model], pub.overrides(row, 94)[0] + [
        "parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false"]))
    assert off.tokens_per_s_per_gpu < st.tokens_per_s_per_gpu


@pytest.mark.parametrize("row", H100, ids=lambda r: r.label)
def test_h100_row_fits_and_estimate_within_20_percent(row):
    cfg = _cfg(row)
    assert [v.rule_id for v in validate(cfg)] == []
    mem = estimate_memory(cfg)
    assert mem.fits, f"{row.label}: {mem.worst.total / 1e9:.1f} GB of {mem.capacity / 1e9:.1f}"
    st = estimate_step_time(cfg)
    ratio = st.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu
    assert 0.8 <= ratio <= 1.2, f"{row.label}: estimate {st.tokens_per_s_per_gpu:.0f} vs published {row.tokens_per_s_per_gpu:.0f}"
    # the stated uncertainty covers the published figure
    assert abs(ratio - 1) <= st.spread


def test_405b_published_split_counts_embedding_and_loss():
    row = next(r for r in H100 if r.model == "LLAMA3.1_405B")
    cfg = _cfg(row)
    assert cfg.parallel.account_for_embedding_in_pipeline_split and cfg.parallel.account_for_loss_in_pipeline_split


def test_search_ranks_published_llama70b_h100_fp8_layout_in_top_five():
    row = next(r for r in H100 if r.model == "LLAMA3_70B")
    cfg = _cfg(row)
    result = search_layouts(cfg, top=5)
    layouts = [(c.cfg.parallel.tp, c.cfg.parallel.pp, c.cfg.parallel.vpp, c.cfg.parallel.cp, c.cfg.train.micro_batch_size)
               for c in result.best]
    assert (row.tp, row.pp, row.vp, row.cp, row.mbs) in layouts, layouts


def test_plan_prints_uncertainty_dominant_terms_and_assumptions(capsys):
    from megatron_recipes.cli import main

    row = next(r for r in H100 if r.model == "LLAMA3_70B")
    overrides, _ = pub.overrides(row, 80)
    assert main(["plan", "llama3_70b_pretrain", *overrides]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "tokens/s/GPU, likely" in out and "(+/-15%)" in out
    assert "dominant terms: gemm" in out and "fp8 GEMMs at 60% of their peak" in out
    assert "assumed: TP communication" in out


def test_uncalibrated_formats_and_systems_widen_the_stated_uncertainty():
    row = next(r for r in H100 if r.model == "LLAMA3_70B")
    overrides, _ = pub.overrides(row, 80)
    h100 = estimate_step_time(compose_recipe("llama3_70b_pretrain", overrides))
    gb200 = estimate_step_time(compose_recipe("llama3_70b_pretrain", overrides + ["cluster=gb200_nvl72", "cluster.nodes=16"]))
    mx = estimate_step_time(compose_recipe("llama3_70b_pretrain", overrides + ["cluster=gb200_nvl72", "cluster.nodes=16", "precision=mxfp8"]))
    assert h100.spread < gb200.spread < mx.spread
    assert any("blackwell" in a for a in gb200.assumptions)


def test_search_finds_the_published_405b_split_and_prints_it():
    """126 layers over pp=8 only split with the embedding and loss counted: --search must enumerate that
    split and hand it back as overrides that plan accepts."""
    row = next(r for r in H100 if r.model == "LLAMA3.1_405B")
    cfg = _cfg(row)
    from megatron_recipes.plan.search import enumerate_layouts

    counted = [c for c in enumerate_layouts(cfg) if c.parallel.pp == 8 and c.parallel.vpp == 8 and c.parallel.tp == 8
               and c.parallel.cp == 2 and c.parallel.account_for_embedding_in_pipeline_split]
    assert counted, "the published 405B layout is not in the search space"
    overrides = [o for o in search_layouts(cfg, top=1).best[0].overrides() if "account_for" in o]
    assert len(overrides) == 2


def test_cp_communication_depends_on_cp_comm_type():
    """p2p hides the K/V ring behind attention; all_gather and a2a expose theirs (TE's CP kinds)."""
    row = next(r for r in H100 if r.model == "LLAMA3.1_405B")
    base = pub.overrides(row, 126)[0]
    times = {kind: estimate_step_time(compose_recipe("llama31_405b_pretrain", base + [f"parallel.cp_comm_type={kind}"])).cp
             for kind in ("p2p", "all_gather", "a2a")}
    assert times["p2p"] == 0.0 < times["all_gather"] and times["a2a"] > 0.0
    no_cp = estimate_step_time(compose_recipe("llama31_405b_pretrain", base + ["parallel.cp=1", "cluster.nodes=64"]))
    assert no_cp.cp == 0.0
