"""The planner's pipeline split (config/derived.py) against megatron-core's own placement functions, for
even, first/last-stage and embedding/loss-counted splits: the planner and the trainer must agree."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.validation.validate import validate

CASES = [
    # (num_layers, pp, vpp, first, last, account_embedding, account_loss)
    (126, 8, 8, None, None, True, True),  # Llama 3.1 405B as published: 126 + 2 = 8 x 8 x 2
    (126, 8, None, None, None, True, True),
    (31, 4, None, None, None, True, False),
    (30, 4, 2, None, None, True, True),
    (61, 16, None, 3, 2, False, False),
    (20, 4, 2, 4, 4, False, False),
    (16, 4, 2, None, None, False, False),
]


def _mcore(layers, pp, vpp, first, last, emb, loss):
    return TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_planner_split_matches_megatron_core(case):
    layers, pp, vpp, first, last, emb, loss = case
    over = [f"model.num_layers={layers}", f"parallel.pp={pp}", f"parallel.vpp={vpp or 'null'}",
            f"parallel.num_layers_in_first_pipeline_stage={first or 'null'}",
            f"parallel.num_layers_in_last_pipeline_stage={last or 'null'}",
            f"parallel.account_for_embedding_in_pipeline_split={str(emb).lower()}",
            f"parallel.account_for_loss_in_pipeline_split={str(loss).lower()}",
            f"cluster.gpus_per_node={pp}", "cluster.nodes=1", "train.global_batch_size=" + str(pp * 2),
            "train.micro_batch_size=1"]
    cfg = compose_recipe("tiny_llama_cpu", over)
    assert not [v for v in validate(cfg) if v.rule_id == "pp.layer_split"]
    tc = _mcore(layers, pp, vpp, first, last, emb, loss)
    ours = derived.pipeline_stage_layers(cfg)
    for rank in range(pp):
        for v in range(vpp or 1):
            vp = v if vpp else None
            n = get_num_layers_to_build(tc, vp_stage=vp, pp_rank=rank)
            offset = get_transformer_layer_offset(tc, vp_stage=vp, pp_rank=rank)
            assert ours[rank][v] == range(offset, offset + n), (rank, v)
    assert sorted(i for stage in ours for chunk in stage for i in chunk) == list(range(layers))


def test_uneven_405b_layout_error_proposes_the_counted_split():
    cfg = compose_recipe("llama31_405b_pretrain", ["parallel.pp=8", "parallel.vpp=8", "cluster.nodes=128"])
    msg = next(v for v in validate(cfg) if v.rule_id == "pp.layer_split").message
    assert "parallel.account_for_embedding_in_pipeline_split=true" in msg and "126+2 = 128" in msg


# --- parallel.pipeline_layout: our torch-free reading against megatron-core's PipelineParallelLayerLayout ---

LAYOUTS = [
    # (layout, pp, vpp, num_layers, mtp_num_layers)
    ("Et|(tt|)*30mL", 16, 2, 61, 1),  # DeepSeek-V3's 61 layers + MTP on PP=16 x VPP=2
    ("Et*3|(tt|)*29,m|L", 16, 2, 61, 1),  # the same as Megatron-LM's documentation writes it (MTP alone on rank 14)
    ("Ettt|tttL", 2, None, 6, None),
    ("E|t*4|t*4|tL", 4, None, 9, None),  # the embedding alone on the first stage
    ("Ett|tt|tt|ttL", 2, 2, 8, None),
    ("E,t*2|(t|)*2t,L", 4, None, 5, None),
    ("Et*3|t*2|tt|t,m,L", 4, None, 8, 1),  # MTP with the loss, on the last rank
]


def _layout_config(layout, pp, vpp, layers, mtp):
    return TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32, mtp_num_layers=mtp,
        pipeline_model_parallel_layout=layout,
    )


@pytest.mark.parametrize("case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_pipeline_layout_places_layers_as_megatron_core_does(case, monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_recipes.config import pipeline_layout

    layout, pp, vpp, layers, mtp = case
    theirs = PipelineParallelLayerLayout.parse_str_to_list(layout)
    short = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    assert pipeline_layout.stages(layout) == ["".join(short[x.name] for x in stage) for stage in theirs]
    assert pipeline_layout.problems(layout, pp, vpp, layers, mtp) == []
    tc = _layout_config(layout, pp, vpp, layers, mtp)  # megatron-core's own validation accepts it too
    over = [f"model.num_layers={layers}", f"parallel.pp={pp}", f"parallel.vpp={vpp or 'null'}",
            f"parallel.pipeline_layout='{layout}'", f"cluster.gpus_per_node={pp}", "cluster.nodes=1",
            f"train.global_batch_size={pp * 2}", "train.micro_batch_size=1"] + ([f"model.mtp_num_layers={mtp}"] if mtp else [])
    cfg = compose_recipe("tiny_llama_cpu", over)
    assert not [v for v in validate(cfg) if v.rule_id in ("pp.pipeline_layout", "pp.layer_split")]
    ours = derived.pipeline_stage_layers(cfg)
    monkeypatch.setattr(parallel_state, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", vpp)  # read per vp_stage
    placed = tc.pipeline_model_parallel_layout
    for rank in range(pp):
        for v in range(vpp or 1):
            vp = v if vpp else None
            # what get_num_layers_to_build / get_transformer_layer_offset return on that rank (they read the
            # rank from parallel_state when a layout is set)
            n = placed.get_num_layers_to_build(layer_type=LayerType.decoder, vp_stage=vp, pp_rank=rank)
            offset = placed.get_layer_offset(layer_type=LayerType.decoder, vp_stage=vp, pp_rank=rank)
            assert ours[rank][v] == range(offset, offset + n), (rank, v)
    assert sorted(i for stage in ours for chunk in stage for i in chunk) == list(range(layers))
    assert pipeline_layout.mtp_rank(layout, pp) == (next(
        (r for r in range(pp) if any(LayerType.mtp in c for c in placed.layout[r])), None))


BAD_LAYOUTS = [
    # (layout, pp, vpp, num_layers, mtp, what our message says) - megatron-core refuses each as well
    ("Ett|tL", 4, None, 3, None, "do not divide over parallel.pp=4"),
    ("tEt|tL", 2, None, 3, None, "embedding (E) must appear exactly once, first"),
    ("Ett|Lt", 2, None, 3, None, "loss (L) must appear exactly once, last"),
    ("Ett|ttL", 2, None, 5, None, "places 4 decoder layers (t), model.num_layers=5"),
    ("Ett|tmtL", 2, None, 4, 1, "every decoder layer (t) must come before the MTP layers"),
    ("Ett|ttL", 2, None, 4, 1, "places 0 MTP layers (m), model.mtp_num_layers=1"),
    ("Etx|ttL", 2, None, 4, None, "unknown layer character(s) 'x'"),
    ("Ett|tt|t|tL", 2, 3, 6, None, "make 2 virtual stage(s) per rank, but parallel.vpp=3"),
]


@pytest.mark.parametrize("case", BAD_LAYOUTS, ids=[c[0] + "-" + c[5][:20] for c in BAD_LAYOUTS])
def test_pipeline_layout_problems_are_named_where_megatron_core_refuses(case):
    from megatron_recipes.config import pipeline_layout

    layout, pp, vpp, layers, mtp, said = case
    assert any(said in p for p in pipeline_layout.problems(layout, pp, vpp, layers, mtp)), \
        pipeline_layout.problems(layout, pp, vpp, layers, mtp)
    with pytest.raises((AssertionError, ValueError, KeyError)):
        _layout_config(layout, pp, vpp, layers, mtp)


def test_empty_pipeline_stage_is_refused_before_it_hangs():
    """megatron-core builds an empty stage (Megatron-LM #1852: the schedule then waits forever); refused here."""
    from megatron_recipes.config import pipeline_layout

    assert any("hold nothing" in p for p in pipeline_layout.problems("Ett||ttL", 3, None, 4, None))
    cfg = compose_recipe("tiny_llama_cpu", ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2",
                                            "parallel.pipeline_layout='Et|t||ttL'"])
    msg = next(v.message for v in validate(cfg) if v.rule_id == "pp.pipeline_layout")
    assert "stage(s) 2 hold nothing" in msg
    # megatron-core takes the virtual stages from the layout when vpp is unset; the recipe's vpp is what the
    # process groups are built with, so it must say the same
    unset = compose_recipe("tiny_llama_cpu", ["parallel.tp=1", "parallel.pp=2", "parallel.pipeline_layout='Et|t|t|tL'"])
    assert "set parallel.vpp=2" in next(v.message for v in validate(unset) if v.rule_id == "pp.pipeline_layout")
    both = compose_recipe("tiny_llama_cpu", ["parallel.tp=1", "parallel.pp=2", "parallel.pipeline_layout='Ett|ttL'",
                                             "parallel.account_for_loss_in_pipeline_split=true"])
    assert "cannot be combined with parallel.account_for_loss_in_pipeline_split" in next(
        v.message for v in validate(both) if v.rule_id == "pp.pipeline_layout")


def test_last_stage_size_without_pipeline_parallelism_is_refused():
    """Megatron-LM #1778: decoder_last_pipeline_num_layers with PP=1 silently dropped layers; refused here."""
    cfg = compose_recipe("tiny_llama_cpu", ["parallel=none", "parallel.num_layers_in_last_pipeline_stage=2"])
    found = {v.rule_id: v.message for v in validate(cfg)}
    assert "pp.layer_split" in found and "need parallel.pp > 1" in found["pp.layer_split"], found


def test_a_recipe_layout_that_a_command_line_vpp_contradicts_is_refused():
    """Megatron-Bridge #1502: DeepSeek-V3's layout, written for the recipe's VPP, met a VPP given on the command
    line; here the layout is checked against the degrees the run ends up with, and the message says so."""
    cfg = compose_recipe("deepseek_v3_pretrain", ["parallel.vpp=2"])  # its layout has 8 x 4 stages
    found = {v.rule_id: v.message for v in validate(cfg)}
    assert "pp.pipeline_layout" in found and "vpp" in found["pp.pipeline_layout"].lower(), found
