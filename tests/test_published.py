"""The planner against published measurements: every DGX-H100 row of a family we ship must plan as FITS,
pass every rule, and estimate tokens/s/GPU within +/-20% of what NVIDIA measured (the rows the constants
in estimate/rates.py were calibrated on). Other systems' rows are reported by
benchmarks/published_throughput.py, not asserted: they check the model, they do not tune it."""

from __future__ import annotations

import pytest

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
    assert {"LLAMA3_70B", "LLAMA3.1_405B", "Qwen3_30B_a3B"} <= models
    assert all(r.model in pub.RECIPES for r in pub.load())


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
