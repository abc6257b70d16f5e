"""Selective recompute by module (``train.recompute_modules``, megatron-core's recompute_modules).

- The modules are megatron-core's: the names the installed release's TransformerConfig accepts are
  ``mcore_compat.recompute_modules()`` (read from its own refusal), and they reach the config and the modules
  megatron-core builds on the CPU lane (each layer's recompute flags).
- Recomputing changes what a layer keeps for backward, never what it computes: the trainer (real ranks on
  gloo, fp32) trains the tiny MoE (a dense first layer, shared experts, an auxiliary load-balancing loss) at
  TP2 + SP with ``[core_attn, mlp, shared_experts]`` and with ``[moe]``, and a tiny MLA model with
  ``[mla_up_proj, core_attn, mlp]``, to the same per-step losses and gradient norms, bit for bit, as without
  recompute. ``layernorm`` trains alike within float32 rounding, not bit for bit: the norm's input also feeds
  the residual, and megatron-core's ``CheckpointWithoutOutput`` hands back the norm's whole input gradient,
  which autograd then adds to the residual's, where without it the composite torch norm's two uses of its input
  are added to the residual's one by one: the same sum in another grouping (shown on one norm below; measured
  up to 2e-7 relative in the gradient norm). TE's fused norm uses its input once. What each set drops is
  measured in tests/test_estimates_activations.py.
- ``moe_act`` runs only in Transformer Engine's grouped experts: refused on the CPU lane, by the CPU-cluster
  recipe rule and the machine rule; as a GPU run builds it (tests/helpers/te_structure.py, TE import stub) the
  DeepSeek-V3 and Mixtral configs with the published runs' module sets pass megatron-core's validation with TE's
  grouped experts, and megatron-core refuses FP8 delayed scaling with moe_act as rule recompute.fp8_delayed does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

import train_support as ts
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError

SEL = "train.recompute=selective"
MLA = ["model.multi_latent_attention=true", "model.qk_layernorm=true", "model.q_lora_rank=32", "model.kv_lora_rank=32",
       "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16", "model.num_query_groups=4"]
MOE = ["model=tiny_moe", "model.moe_first_dense_layers=1", "model.moe_shared_expert_intermediate_size=128",
       "model.moe_router_load_balancing_type=aux_loss", "model.moe_aux_loss_coeff=0.01"]
HELPER = Path(__file__).parent / "helpers" / "te_structure.py"


def _modules(*names: str) -> List[str]:
    return [SEL, f"train.recompute_modules=[{','.join(names)}]"]


def _config(overrides):
    from megatron_recipes.models.transformer_config import build_transformer_config

    return build_transformer_config(compose_recipe("tiny_llama_cpu", ["parallel=none", *overrides]), use_te=False, cpu_init=True)


def test_the_allowed_modules_are_the_installed_megatron_cores():
    """megatron-core's TransformerConfig names the modules it allows when it refuses another one."""
    from megatron.core.transformer import TransformerConfig

    from megatron_recipes.config.schema import RECOMPUTE_MODULES
    from megatron_recipes.runtime import mcore_compat

    with pytest.raises(AssertionError) as info:
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, recompute_granularity="selective",
                          recompute_modules=["not_a_module"])
    allowed = set(re.findall(r"'(\w+)'", str(info.value).split("Allowed modules are:")[1]))
    assert allowed == set(mcore_compat.recompute_modules())
    assert set(RECOMPUTE_MODULES) <= allowed  # the project's are offered by every supported release


def test_modules_reach_megatron_cores_config():
    config = _config([*MOE, *_modules("moe", "layernorm")])
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["moe", "layernorm"])
    assert config.recompute_method is None and config.recompute_num_layers is None
    full = _config(["train.recompute=full"])
    assert (full.recompute_granularity, full.recompute_method, full.recompute_modules) == ("full", "uniform", ["core_attn"])
    assert _config([SEL]).recompute_modules == ["core_attn"]  # selective as before: core attention
    assert _config([]).recompute_granularity is None


def _layer_flags(overrides):
    """(rank) Which of megatron-core's recompute paths the built layers took, per layer."""
    import torch
    from megatron.core import parallel_state

    from megatron_recipes.models.builder import build_gpt_model
    from megatron_recipes.runtime import distributed

    cfg = compose_recipe("tiny_llama_cpu", ["parallel=none", "cluster.gpus_per_node=1", *overrides])
    distributed.init_model_parallel(cfg)
    torch.manual_seed(0)
    model = build_gpt_model(cfg)
    flags = []
    for layer in model.decoder.layers:
        attention, mlp = layer.self_attention, layer.mlp
        flags.append({
            "input_layernorm": layer.recompute_input_layernorm, "pre_mlp_layernorm": layer.recompute_pre_mlp_layernorm,
            "mlp": layer.recompute_mlp, "core_attn": attention.checkpoint_core_attention,
            "mla_up_proj": getattr(attention, "recompute_up_proj", None),
            "moe": getattr(mlp, "moe_layer_recompute", None), "shared_experts": getattr(mlp, "shared_experts_recompute", None),
        })
    parallel_state.destroy_model_parallel()
    return flags


def test_the_layers_megatron_core_builds_take_the_modules():
    from multiproc import run_ranks

    moe, mla = run_ranks(_layer_flags, 1, [*MOE, *_modules("layernorm", "mlp", "shared_experts")], timeout=600)[0], \
        run_ranks(_layer_flags, 1, [*MLA, *_modules("mla_up_proj", "core_attn")], timeout=600)[0]
    dense, expert = moe[0], moe[1]
    assert dense["mlp"] and not expert["mlp"]  # megatron-core recomputes dense MLPs only
    assert all(f["input_layernorm"] and f["pre_mlp_layernorm"] for f in moe)  # the local spec's norms are modules
    assert expert["shared_experts"] and not expert["moe"] and not any(f["core_attn"] for f in moe)
    assert all(f["mla_up_proj"] and f["core_attn"] and not f["mlp"] and not f["input_layernorm"] for f in mla)


# --- the cost model ------------------------------------------------------------------------------------------------


def test_plan_charges_the_forward_each_module_repeats_and_credits_what_it_drops():
    """Llama 3 70B (dense, TE kernels): recomputing MLPs repeats their share of the layers' GEMMs (from the FLOPs
    count, not the recompute code) and drops their activations but the block's input; DeepSeek-V3: mla_up_proj
    frees memory for the up-projections' GEMMs, and recomputing whole MoE layers repeats their exchanges."""
    from megatron_recipes.config import derived
    from megatron_recipes.estimate import activations, cost
    from megatron_recipes.estimate.memory import estimate_memory
    from megatron_recipes.estimate.steptime import estimate_step_time

    base = ["parallel.pp=1", "parallel.vpp=null", "parallel.num_layers_in_first_pipeline_stage=null",
            "parallel.num_layers_in_last_pipeline_stage=null"]  # one stage: the same one is the slowest in each
    plain, mlp, full = (compose_recipe("llama3_70b_pretrain", [*base, *extra])
                        for extra in ([], _modules("mlp"), ["train.recompute=full"]))
    attn_mm, mlp_mm, _ = cost.kind_forward_parts(plain.model, False, plain.train.seq_length)
    st_plain, st_mlp, st_full = (estimate_step_time(c) for c in (plain, mlp, full))
    # full recompute repeats every layer's forward, mlp the MLPs' share of it
    assert st_mlp.gemm - st_plain.gemm == pytest.approx((st_full.gemm - st_plain.gemm) * mlp_mm / (attn_mm + mlp_mm))
    assert st_mlp.attention == st_plain.attention < st_full.attention
    x = activations.dims_of(plain)
    assert activations.kind_bytes(mlp, False) == pytest.approx(
        activations.attention_bytes(plain, x) + x.tokens * x.hidden / x.sp * x.act)
    assert estimate_memory(mlp).worst.total < estimate_memory(plain).worst.total

    blocking = ["parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false"]  # EP exchanges
    ds = compose_recipe("deepseek_v3_pretrain", [*blocking, "train.recompute=none"])
    up = compose_recipe("deepseek_v3_pretrain", [*blocking, *_modules("mla_up_proj")])
    assert estimate_memory(up).worst.total < estimate_memory(ds).worst.total
    assert estimate_step_time(up).gemm > estimate_step_time(ds).gemm
    whole = estimate_step_time(compose_recipe("deepseek_v3_pretrain", [*blocking, *_modules("moe")]))
    assert whole.ep == pytest.approx(1.5 * estimate_step_time(ds).ep) and derived.is_moe(ds.model)


# --- training with and without recompute: the same numbers ------------------------------------------------------

STEPS = 4
COMMON = [*ts.FAST, f"train.train_iters={STEPS}", "checkpoint.save=false", "checkpoint.load=none", "parallel=none",
          "precision=fp32", "optimizer.lr_warmup_iters=1", "parallel.tp=2", "parallel.sp=true"]
CASES = {  # name -> (model, recompute modules, relative tolerance: 0 = bit for bit)
    "moe_parts": (MOE, ("core_attn", "mlp", "shared_experts"), 0.0),
    "moe_whole": (MOE, ("moe",), 0.0),
    "mla": (MLA, ("mla_up_proj", "core_attn", "mlp"), 0.0),
    "moe_layernorm": (MOE, ("layernorm", "moe"), 1e-6),  # the gradient sum's grouping (module docstring)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    base = tmp_path_factory.mktemp("recompute")
    out = {}
    for name, (model, modules, _) in CASES.items():
        key = "moe" if model is MOE else "mla"
        if key not in out:
            out[key] = ts.train(base / key, cache, *COMMON, *model, nproc=2).check()
        out[name] = ts.train(base / name, cache, *COMMON, *model, *_modules(*modules), nproc=2).check()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_selective_recompute_trains_like_no_recompute(runs, case):
    model, _, tolerance = CASES[case]
    plain, recomputed = runs["moe" if model is MOE else "mla"], runs[case]
    assert "selective" in (recomputed.run_dir / "config.yaml").read_text()
    for key in ("loss", "grad_norm"):
        assert len(plain.series(key)) == STEPS, plain.output[-3000:]
        if tolerance:
            assert max(ts.relative_diffs(recomputed.series(key), plain.series(key))) <= tolerance, key
        else:
            assert recomputed.series(key) == plain.series(key), key
    losses = plain.series("loss")
    assert losses[-1] != losses[0], "training did not change the loss: the comparison would be vacuous"


def _norm_input_grads():
    """(rank) One norm whose input also feeds a residual: its input gradient without and with megatron-core's
    output-discarding checkpoint, and the checkpoint's gradient against residual + the norm's whole gradient."""
    import torch
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    from megatron_recipes.runtime import cpu_lane, patches

    cpu_lane.activate()  # the RNG states the checkpoint saves
    patches.apply("no_te")
    torch.manual_seed(0)
    norm, weight = torch.nn.RMSNorm(128, eps=1e-5), torch.randn(128, 128) / 10
    x0, grad = torch.randn(64, 128), torch.randn(64, 128)

    def input_grad(recompute: bool):
        x = x0.clone().requires_grad_()
        h = x * 1.0
        checkpoint = CheckpointWithoutOutput() if recompute else None
        normed = checkpoint.checkpoint(norm, h) if recompute else norm(h)
        mixed = normed @ weight
        if recompute:
            checkpoint.discard_output_and_register_recompute(mixed)
        (h + mixed).backward(grad)
        return x.grad

    x = x0.clone().requires_grad_()
    norm_grad, = torch.autograd.grad(norm(x), x, grad @ weight.T)
    plain, recomputed = input_grad(False), input_grad(True)
    return torch.equal(recomputed, grad + norm_grad), ((recomputed - plain).abs().max() / plain.abs().max()).item()


def test_layernorm_recompute_groups_the_norm_inputs_gradient_differently():
    """Why ``layernorm`` is float32-close and not bit-identical (module docstring), on one norm."""
    from multiproc import run_ranks

    regrouped, differs = run_ranks(_norm_input_grads, 1, timeout=600)[0]
    assert regrouped and differs < 1e-6


# --- what only Transformer Engine runs ------------------------------------------------------------------------


def test_moe_act_is_refused_on_the_cpu_lane_and_without_te():
    from megatron_recipes.models.capabilities import Machine, unmet_requirements
    from megatron_recipes.validation.validate import validate

    lane = compose_recipe("tiny_llama_cpu", ["parallel=none", *MOE, *_modules("moe_act")])
    found = {v.rule_id: v.message for v in validate(lane)}
    assert "grouped GEMM" in found.get("recompute.modules_in_model", ""), found
    cpu = Machine(cuda=False, transformer_engine=False, deep_ep=False, compute_capability=(0, 0))
    assert any("moe_act" in p and "no GPU" in p for p in unmet_requirements(lane, cpu))
    with pytest.raises(RecipeError, match="moe_grouped_gemm"):  # megatron-core itself, past the rules
        _config([*MOE, *_modules("moe_act")])


def test_fp8_moe_act_and_layernorm_recompute_need_te_2_6():
    from megatron_recipes.models.capabilities import Machine, unmet_requirements

    cfg = compose_recipe("mixtral_8x7b_pretrain", ["precision=fp8_tensorwise", *_modules("moe_act", "layernorm")])
    old, new = (Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0), te_version=v)
                for v in ((2, 5), (2, 6)))
    assert any("2.6" in p for p in unmet_requirements(cfg, old))
    assert unmet_requirements(cfg, new) == []


# cases for tests/helpers/te_structure.py: recipe/precision/override...
STRUCTURE = {
    # the published DeepSeek-V3 runs' sets (Megatron-Bridge 26.04 performance configs) and everything at once
    "deepseek_h100": "deepseek_v3_pretrain/bf16/" + "/".join(_modules("mla_up_proj", "mlp")),
    "deepseek_nvfp4": "deepseek_v3_pretrain/nvfp4/" + "/".join(_modules("mla_up_proj", "layernorm", "moe_act")),
    "deepseek_all": "deepseek_v3_pretrain/mxfp8/" + "/".join(_modules("core_attn", "mla_up_proj", "layernorm", "mlp", "moe_act",
                                                                           "shared_experts")),
    "mixtral_moe": "mixtral_8x7b_pretrain/bf16/" + "/".join(_modules("moe", "layernorm")),
    "mixtral_fp8_delayed": "mixtral_8x7b_pretrain/fp8_delayed/" + "/".join(_modules("moe_act")),
}


@pytest.fixture(scope="module")
def structure():
    proc = subprocess.run([sys.executable, str(HELPER), *STRUCTURE.values()], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    return {name: found[case] for name, case in STRUCTURE.items()}


@pytest.mark.parametrize("name", [n for n in STRUCTURE if n != "mixtral_fp8_delayed"])
def test_gpu_configs_with_recompute_modules_pass_megatron_cores_validation(structure, name):
    r = structure[name]
    assert r["error"] is None, r
    modules = STRUCTURE[name].rsplit("=[", 1)[1].rstrip("]").split(",")
    assert r["recompute_granularity"] == "selective" and r["recompute_modules"] == modules
    assert r["experts"] == "TEGroupedMLP" and r["spec"].startswith("TE")


def test_megatron_core_refuses_fp8_delayed_moe_act_as_the_rule_does(structure):
    from megatron_recipes.validation.validate import validate

    recipe, precision, *extra = STRUCTURE["mixtral_fp8_delayed"].split("/")
    assert "recompute.fp8_delayed" in [v.rule_id for v in validate(compose_recipe(recipe, [f"precision={precision}", *extra]))]
    assert "Delayed scaling does not support moe_act" in (structure["mixtral_fp8_delayed"]["error"] or "")
