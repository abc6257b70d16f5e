"""The one cost model (estimate/cost.py): FLOPs per token against the model megatron-core builds and the
6N + attention identity, and ``plan`` and ``train`` reporting the same MFU for the same step time."""

from __future__ import annotations

import pytest

from megatron_recipes.config import derived
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate import cost
from megatron_recipes.estimate.params import model_params
from megatron_recipes.estimate.steptime import estimate_step_time


def _cfg(*overrides):
    return compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1", *overrides])


def _matmul_params(cfg) -> int:
    """Weights that multiply activations, counted on the real megatron-core model (1 rank)."""
    from data_support import one_rank_group

    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed

    with one_rank_group():
        distributed.init_model_parallel(cfg)
        try:
            model = build_model_chunks(cfg)[0]
            return sum(
                p.numel()
                for name, p in model.named_parameters()
                if p.dim() == 2 and "word_embeddings" not in name and "router" not in name
            )
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()


def test_flops_per_token_is_six_times_matmul_params_plus_causal_attention():
    cfg = _cfg()
    m, seq = cfg.model, cfg.train.seq_length
    attention = 6 * m.num_layers * seq * m.hidden_size  # 12 * L * seq * (heads * head_dim), halved: causal
    assert cost.flops_per_token(cfg) == pytest.approx(6 * _matmul_params(cfg) + attention, rel=1e-12)
    assert cost.flops_per_step(cfg) == cost.flops_per_token(cfg) * cfg.train.global_batch_size * seq


def test_moe_flops_count_only_the_routed_experts():
    dense = _cfg()
    moe = compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1", "model=tiny_moe"])
    m = moe.model
    per_expert = 3 * 2 * m.hidden_size * m.moe_ffn_hidden_size
    router = 2 * m.hidden_size * m.num_moe_experts
    assert m.moe_router_topk < m.num_moe_experts
    dense_like = compose_recipe(
        "tiny_llama_cpu",
        ["parallel=none", "cluster.gpus_per_node=1", "model=tiny_moe", "model.num_moe_experts=null", f"model.ffn_hidden_size={m.moe_ffn_hidden_size}"],
    )
    extra = m.num_layers * 3 * (per_expert * (m.moe_router_topk - 1) + router)
    assert cost.flops_per_token(moe) == pytest.approx(cost.flops_per_token(dense_like) + extra, rel=1e-12)
    assert dense.model.num_moe_experts is None


def test_mfu_is_none_on_cpu_and_a_fraction_with_a_peak_rate():
    cpu = _cfg()
    assert cost.mfu(cpu, 1.0) is None
    gpu = _cfg("cluster=h100_8gpu", "cluster.gpus_per_node=1")
    peak = gpu.cluster.peak_bf16_tflops * 1e12
    assert cost.mfu(gpu, 0.5) == pytest.approx(cost.flops_per_step(gpu) / 0.5 / peak)


def test_model_flops_follow_6n_plus_attention():
    cfg = compose_recipe("llama3_8b_pretrain", ["parallel.tp=4"])
    m, tp = cfg.model, cfg.parallel.tp
    assert derived.padded_vocab_size(m, tp) > derived.padded_vocab_size(m, 1)  # TP 4 pads: the case that differs
    matmul_params = model_params(cfg).total - derived.padded_vocab_size(m, 1) * m.hidden_size  # minus the lookup
    matmul_params -= (2 * m.num_layers + 1) * m.hidden_size  # norms are not matmuls
    # the logits are counted over the vocabulary padded at the run's TP, the output layer megatron-core builds
    # (and what Megatron-LM and Megatron-Bridge count for their published MFU)
    matmul_params += (derived.padded_vocab_size(m, tp) - derived.padded_vocab_size(m, 1)) * m.hidden_size
    expected = 6 * matmul_params + 6 * m.num_layers * cfg.train.seq_length * m.hidden_size
    assert cost.flops_per_token(cfg) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("recipe", ["llama3_8b_pretrain", "mixtral_8x7b_pretrain", "qwen3_30b_a3b_pretrain", "deepseek_v3_pretrain"])
def test_plan_and_train_report_the_same_mfu(recipe):
    """``plan``'s MFU for its estimated step time is what the trainer logs for a step that took that long."""
    from megatron_recipes.training import loop  # the trainer's MFU is the one it logs

    cfg = compose_recipe(recipe, ["parallel.tp=4"] if recipe == "llama3_8b_pretrain" else [])  # TP 4 pads
    st = estimate_step_time(cfg)
    assert loop.cost.mfu(cfg, st.total) == pytest.approx(st.mfu, rel=1e-12)
    assert st.model_flops_per_token == cost.flops_per_token(cfg)
