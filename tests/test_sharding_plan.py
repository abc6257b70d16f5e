"""Sharding and offload in `plan` (the issue's done-when) and in the one mapping to megatron-core's configs."""

from __future__ import annotations

import json
import re

import pytest

from megatron_recipes.cli import main
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate.memory import estimate_memory
from megatron_recipes.plan.search import INPUT_RULES
from megatron_recipes.validation.validate import validate

F70 = ["llama3_70b_sft_fsdp", "cluster=h100_8gpu", "cluster.nodes=2"]
ZERO1 = ["parallel.fsdp=false", "parallel.sharding=zero1", "optimizer.cpu_offload=false"]


def _plan(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _short_by(out: str) -> float:
    match = re.search(r"short by ([0-9.]+) GB", out)
    assert match, out
    return float(match.group(1))


def test_llama70b_fsdp_fits_on_two_h100_nodes(capsys):
    rc, out, err = _plan(capsys, *F70)
    assert rc == 0, err
    assert "verdict: FITS" in out
    assert "zero3 (Megatron-FSDP) over 16 ranks" in out
    assert "host memory per node:" in out and "of 2048 GB" in out


def test_llama70b_with_sharding_off_does_not_fit_and_says_by_how_much(capsys):
    rc, out, err = _plan(capsys, *F70, *ZERO1)
    assert rc == 2
    assert "DOES NOT FIT" in out and "[memory.fits]" in err
    assert _short_by(out) > 300  # whole bf16 weights + fp32 grads per GPU: ~511 GB of 80
    rc, out, err = _plan(capsys, *F70, "optimizer.cpu_offload=false")  # zero3 alone is not enough either
    assert rc == 2 and 5 < _short_by(out) < 60


def test_plan_json_reports_sharding_and_host_memory(capsys):
    rc, out, _ = _plan(capsys, *F70, "--json")
    assert rc == 0
    mem = json.loads(out)["memory"]
    assert mem["sharding"]["stage"] == "zero3" and mem["sharding"]["dense_shard_ranks"] == 16
    # 70.55B params x 16 B (fp32 master copy, Adam m, v, grad copy) / 16 ranks x 8 ranks per node
    assert mem["host_offload_per_node_gb"] == pytest.approx(70.55 * 16 / 16 * 8, rel=0.01)
    assert mem["host_fits"] and mem["fits"]


def test_host_memory_too_small_is_a_rule_violation(capsys):
    rc, _, err = _plan(capsys, *F70, "cluster.host_memory_gb=256")
    assert rc == 2 and "[memory.host_fits]" in err and "short by" in err


def test_hybrid_instances_shard_over_fewer_ranks():
    base = compose_recipe(F70[0], F70[1:])
    hybrid = compose_recipe(F70[0], F70[1:] + ["parallel.dist_optimizer_instances=2"])
    a, b = estimate_memory(base).worst, estimate_memory(hybrid).worst
    assert b.weights == pytest.approx(2 * a.weights) and b.optimizer == pytest.approx(2 * a.optimizer)


def test_search_adds_sharding_modes_only_when_needed(capsys):
    rc, out, err = _plan(capsys, "llama3_70b_sft", "cluster=h100_8gpu", "cluster.nodes=2", "--search", "--json", "--top", "2")
    assert rc == 0, err
    layouts = json.loads(out)["layouts"]
    assert layouts and all(r["sharding_mode"] for r in layouts)  # ZeRO-1 has no layout that fits on 2 nodes
    for row in layouts:
        cfg = compose_recipe("llama3_70b_sft", row["overrides"])
        assert validate(cfg, skip=INPUT_RULES) == [], row["overrides"]
        assert estimate_memory(cfg).fits and cfg.parallel.fsdp
    rc, out, _ = _plan(capsys, "llama3_70b_pretrain", "cluster=h100_8gpu", "cluster.nodes=8", "--search", "--json", "--top", "2")
    assert rc == 0 and all(r["sharding_mode"] is None for r in json.loads(out)["layouts"])


def test_recipe_keys_reach_megatron_core_configs():
    """Structure test: the DDP/optimizer/TransformerConfig megatron-core gets, exactly as a GPU run builds them."""
    from megatron_recipes.models.transformer_config import build_transformer_config
    from megatron_recipes.training import optim

    cfg = compose_recipe(F70[0], F70[1:] + ["parallel.dist_optimizer_instances=2", "optimizer.offload_fraction=0.5"])
    ddp = optim.ddp_config(cfg)
    assert ddp.use_megatron_fsdp and ddp.data_parallel_sharding_strategy == "optim_grads_params"
    assert ddp.num_distributed_optimizer_instances == 2 and ddp.use_distributed_optimizer
    from megatron_recipes.models.capabilities import Machine, unmet_requirements

    if unmet_requirements(cfg):  # no TE here: the trainer refuses offload before megatron-core sees it
        assert any("optimizer.cpu_offload needs a GPU and Transformer Engine" in p for p in unmet_requirements(cfg))
        assert unmet_requirements(cfg, Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0))) == []
    else:
        oc = optim.optimizer_config(cfg)
        assert oc.optimizer_cpu_offload and oc.optimizer_offload_fraction == 0.5 and oc.use_precision_aware_optimizer
    for stage, strategy in (("zero1", "optim"), ("zero2", "optim_grads")):
        assert optim.ddp_config(compose_recipe(F70[0], F70[1:] + [f"parallel.sharding={stage}"])).data_parallel_sharding_strategy == strategy
    plain = optim.ddp_config(compose_recipe("llama3_70b_sft", []))
    assert not plain.use_megatron_fsdp and plain.data_parallel_sharding_strategy == "no_shard"
    assert not optim.optimizer_config(compose_recipe("llama3_70b_sft", [])).optimizer_cpu_offload
    tc = build_transformer_config(compose_recipe("llama3_8b_pretrain", ["train.activation_offload_layers=8"]), use_te=False, cpu_init=True)
    assert tc.cpu_offloading and tc.cpu_offloading_num_layers == 8 and tc.cpu_offloading_activations
    assert not build_transformer_config(compose_recipe("llama3_8b_pretrain", []), use_te=False, cpu_init=True).cpu_offloading


def test_launch_environment_gives_megatron_fsdp_several_queues():
    from megatron_recipes.slurm.environment import derive_env

    def value(*overrides):
        env = {v.name: v.value for v in derive_env(compose_recipe(F70[0], F70[1:] + list(overrides)))}
        return env.get("CUDA_DEVICE_MAX_CONNECTIONS")

    assert value() == "8" and value("parallel.tp=4", "parallel.sp=true") == "8"
    assert value("parallel.fsdp=false", "parallel.sharding=zero1", "parallel.tp=4", "parallel.sp=true") == "1"
