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
