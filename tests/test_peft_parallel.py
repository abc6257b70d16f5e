"""Adapters under tensor, sequence, pipeline and expert parallelism give the single-rank numbers.

Real gloo ranks train the tiny model for a few steps through megatron-core's DDP, optimizer and pipeline
schedules. Every layout starts from the same base weights and the same adapters and sees the same
global batches, so each step's loss must match the one-rank run within float32 noise; the frozen base
(parameters and NF4 buffers) must come out bit-identical, and the parameter counts must agree.
"""

from __future__ import annotations

import pytest
import torch

import peft_support as ps

pytestmark = pytest.mark.slow

STEPS = 3
CASES = {
    "lora": ["peft.method=lora"],
    "dora": ["peft.method=dora"],
    "qlora": ["peft.method=qlora", "peft.double_quant=false"],  # first-level NF4 blocks are layout-invariant
    "ptuning": ["peft.method=ptuning", "peft.prefix_length=4", "peft.prefix_projection=true", "peft.prefix_projection_hidden=32"],
    "ptuning_direct": ["peft.method=ptuning", "peft.prefix_length=4"],
    "moe": [
        "model=tiny_moe",
        "parallel.moe_dispatcher=allgather",
        "peft.method=lora",
        "peft.target_modules=[linear_qkv,linear_proj,expert_fc1,expert_fc2]",
    ],
}
LAYOUTS = {
    "tp2": (["parallel.tp=2"], ["lora", "dora", "qlora", "ptuning", "ptuning_direct"]),
    "tp2_sp": (["parallel.tp=2", "parallel.sp=true"], ["lora", "qlora"]),
    "pp2": (["parallel.pp=2"], ["lora", "ptuning"]),
    "ep2": (["parallel.ep=2"], ["moe"]),
}


def _job(world, layout, names):
    out = {}
    for name in names:
        cfg = ps.tiny_cfg(world, *layout, *CASES[name])
        result = ps.train_steps(cfg, STEPS, ps.set_base_weights)
        result.pop("chunks")
        out[name] = result
    return out


@pytest.fixture(scope="module")
def reference():
    return ps.run_ranks(1, _job, 1, [], list(CASES))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_rank(reference, layout):
    overrides, names = LAYOUTS[layout]
    ranks = ps.run_ranks(2, _job, 2, overrides, names)
    for name in names:
        ref = reference[name]
        assert ref["frozen_unchanged"] and ref["frozen_count"] > 0
        for rank, results in enumerate(ranks):
            got = results[name]
            assert got["frozen_unchanged"], f"{layout}/{name}: rank {rank} changed a frozen tensor"
            assert (got["trainable"], got["total"]) == (ref["trainable"], ref["total"]), f"{layout}/{name} counts"
            for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
                assert abs(a - b) <= 1e-5 * abs(a), f"{layout}/{name} step {step + 1}: {b} vs one rank {a}"
        assert len(set(map(tuple, (r[name]["losses"] for r in ranks)))) == 1  # every rank reports the same


def test_adapters_learn_and_only_they_train(reference):
    """The references trained something: losses moved, adapters are a small share of the model."""
    for name, result in reference.items():
        assert result["losses"][0] != result["losses"][-1], name
        assert 0 < result["trainable"] < 0.2 * result["total"], name


def _replicated_after_dropout_training(world, layout):
    cfg = ps.tiny_cfg(world, *layout, *CASES["lora"], "peft.dropout=0.3")
    result = ps.train_steps(cfg, STEPS, ps.set_base_weights)
    return {f"{i}.{n}": p.detach().clone() for i, chunk in enumerate(result["chunks"])
            for n, p in chunk.named_parameters()
            if p.requires_grad and not getattr(p, "tensor_model_parallel", False)}


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true"]], ids=["tp2", "tp2_sp"])
def test_adapter_dropout_keeps_tp_replicas_identical(layout):
    """With dropout on, a replicated factor (column A, row B) sees the same masked input on every TP rank
    (or its partial gradients are summed): its replicas must stay bit-identical, else the ranks silently
    train different models and the checkpoint keeps only one of them."""
    ranks = ps.run_ranks(2, _replicated_after_dropout_training, 2, layout)
    names = sorted(ranks[0])
    assert any("lora_a" in n for n in names) and any("lora_b" in n for n in names)
    assert any(ranks[0][n].abs().sum() > 0 for n in names if "lora_b" in n)  # B left zero: nothing trained
    for name in names:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs between TP ranks"
