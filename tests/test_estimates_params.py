"""The planner's per-rank parameter counts equal what megatron-core builds, rank by rank, and its
rank -> group map equals the process groups megatron-core's ``initialize_model_parallel`` creates.

Models are built by the project's builder (megatron-core ``GPTModel``, local spec, CPU lane) in real
spawned processes over gloo: one rank for single-device layouts, four for TP=2 x PP=2 (with and without
VPP) and expert-parallel layouts. Routed-expert parameters are compared separately from dense ones
because the distributed optimizer shards them over a different group.
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import pytest

from multiproc import run_ranks

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate.groups import build_group_map
from megatron_recipes.estimate.params import stage_params

pytestmark = pytest.mark.slow

BASE = ["data=mock", "precision=fp32"]
EXPERT = re.compile(r"\.experts\.")  # routed experts; shared_experts are dense

MLA = ["model.multi_latent_attention=true", "model.qk_layernorm=true", "model.kv_lora_rank=32", "model.qk_head_dim=16",
       "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16", "model.num_query_groups=4"]

ONE_RANK: Dict[str, List[str]] = {
    "dense_mha": ["model.num_query_groups=4"],
    "gqa": [],
    "tied_embeddings": ["model.tie_embeddings=true"],
    "qk_layernorm_qkv_bias": ["model.qk_layernorm=true", "model.add_qkv_bias=true"],
    "layernorm_gelu_bias": ["model.normalization=LayerNorm", "model.activation=gelu", "model.add_bias_linear=true"],
    "moe": ["model=tiny_moe"],
    "moe_shared_first_dense": ["model=tiny_moe", "model.moe_shared_expert_intermediate_size=192", "model.moe_first_dense_layers=1"],
    "mla_q_lora": [*MLA, "model.q_lora_rank=32"],
    "mla_no_q_lora_mtp": [*MLA, "model.mtp_num_layers=1"],
}

FOUR_RANKS: Dict[str, List[str]] = {
    "gqa_tied_tp2_pp2": ["model.tie_embeddings=true", "parallel.tp=2", "parallel.pp=2"],
    "qk_layernorm_tp2_pp2_vpp2": ["model.qk_layernorm=true", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"],
    "moe_tp2_sp_ep2": ["model=tiny_moe", "parallel.tp=2", "parallel.sp=true", "parallel.ep=2"],
    "moe_pp2_ep2_etp1": ["model=tiny_moe", "parallel.pp=2", "parallel.ep=2", "parallel.etp=1",
                         "model.moe_shared_expert_intermediate_size=128"],
    "mla_mtp_tp2_pp2": [*MLA, "model.q_lora_rank=32", "model.mtp_num_layers=1", "parallel.tp=2", "parallel.pp=2"],
}


def _recipe_overrides(world: int, extra: Sequence[str]) -> List[str]:
    return ["parallel=none", f"cluster.gpus_per_node={world}", "train.global_batch_size=16", "train.micro_batch_size=2", *BASE, *extra]


def _live_groups() -> Dict[str, List[int]]:
    """This rank's groups as megatron-core created them (process-group ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
    }
    return {k: sorted(dist.get_process_group_ranks(g)) for k, g in groups.items()}


def _built_counts(overrides_by_case: Dict[str, List[str]], world: int) -> Dict[str, tuple]:
    """Runs on every rank: build each case's model chunks; (pp_rank, dense, expert, live groups) per case."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed

    out = {}
    for name, extra in overrides_by_case.items():
        cfg = compose_recipe("tiny_llama_cpu", _recipe_overrides(world, extra))
        distributed.init_model_parallel(cfg)
        dense = expert = 0
        for chunk in build_model_chunks(cfg):
            for pname, p in chunk.named_parameters():
                if EXPERT.search(pname):
                    expert += p.numel()
                else:
                    dense += p.numel()
        out[name] = (parallel_state.get_pipeline_model_parallel_rank(), dense, expert, _live_groups())
        parallel_state.destroy_model_parallel()
    return out


def _check(results: List[Dict[str, Tuple[int, int, int]]], cases: Dict[str, List[str]], world: int) -> None:
    for name, extra in cases.items():
        cfg = compose_recipe("tiny_llama_cpu", _recipe_overrides(world, extra))
        for rank, per_case in enumerate(results):
            pp_rank, dense, expert, _ = per_case[name]
            planned = stage_params(cfg, pp_rank)
            assert (planned.dense, planned.expert) == (dense, expert), (
                f"{name}, rank {rank} (pp rank {pp_rank}): planner says dense={planned.dense} expert={planned.expert}, "
                f"megatron-core built dense={dense} expert={expert}"
            )


def test_param_counts_one_rank():
    results = run_ranks(_built_counts, 1, ONE_RANK, 1, timeout=600)
    _check(results, ONE_RANK, 1)
    assert results[0]["moe"][2] > 0 and results[0]["gqa"][2] == 0  # experts were recognised


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_built_counts, 4, FOUR_RANKS, 4, timeout=900)


def test_param_counts_tp2_pp2_and_expert_parallel_four_ranks(four_ranks):
    _check(four_ranks, FOUR_RANKS, 4)
    stages = {r["gqa_tied_tp2_pp2"][0] for r in four_ranks}
    assert stages == {0, 1}  # both pipeline stages were built and compared


def test_group_map_equals_megatron_process_groups(four_ranks):
    for name, extra in FOUR_RANKS.items():
        planned = build_group_map(compose_recipe("tiny_llama_cpu", _recipe_overrides(4, extra)))
        for rank, per_case in enumerate(four_ranks):
            live = per_case[name][3]
            for kind, group_kind in planned.items():
                mine = next(sorted(g) for g in group_kind.groups if rank in g)
                assert mine == live[kind], f"{name}: rank {rank} {kind} group planned {mine}, megatron-core {live[kind]}"
        assert ("ep" in planned) == ("moe" in name)
