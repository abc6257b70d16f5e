"""GPU-path settings decided without a GPU: fused kernels, FP8/FP4 fields, the rank environment, versions.

Each is built through the project's one mapping into megatron-core's real ``TransformerConfig`` (whose
own validation runs), for a machine described as a GPU with Transformer Engine where that matters.
"""

from __future__ import annotations

import pytest

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.models import fusions
from megatron_recipes.models.fusions import Kernels
from megatron_recipes.models.transformer_config import build_transformer_config

GPU = Kernels(cuda=True, transformer_engine=True, te_version=(2, 9))
CPU = Kernels(cuda=False, transformer_engine=False)


def _cfg(*overrides, recipe="tiny_llama_cpu"):
    return compose_recipe(recipe, ["parallel=none", "cluster.gpus_per_node=1", *overrides])


def _gpu_config(cfg):
    # Without Transformer Engine installed megatron-core cannot validate its fused RoPE; the TE
    # structure tests (test_te_structure.py) cover that one with the TE import stub.
    decided = {**fusions.decide(cfg, GPU), "apply_rope_fusion": False}
    return build_transformer_config(cfg, use_te=True, cpu_init=True, fusions=decided)


@pytest.mark.parametrize(
    "overrides, fused",
    [
        ((), True),  # swiglu
        (("model.activation=gelu",), False),  # gelu without bias: megatron-core rejects the fusion
        (("model.activation=gelu", "model.add_bias_linear=true"), True),
        (("model.activation=squared_relu",), False),  # no fused kernel
    ],
)
def test_bias_activation_fusion_follows_the_activation(overrides, fused):
    config = _gpu_config(_cfg(*overrides))
    assert config.bias_activation_fusion is fused


def test_squared_relu_cannot_require_bias_activation_fusion():
    with pytest.raises(RecipeError, match="train.fusions.bias_activation=true: model.activation=squared_relu"):
        fusions.decide(_cfg("model.activation=squared_relu", "train.fusions.bias_activation=true"), GPU)


def test_fusions_on_where_the_kernels_are_off_on_the_cpu_lane():
    dense, moe = _cfg(), _cfg("model=tiny_moe")
    on_gpu = fusions.decide(dense, GPU)
    assert all(on_gpu[f] for f in ("gradient_accumulation_fusion", "apply_rope_fusion", "bias_dropout_fusion"))
    assert not on_gpu["moe_permute_fusion"] and not on_gpu["moe_router_fusion"]  # dense model
    assert fusions.decide(moe, GPU)["moe_router_fusion"]
    old_te = fusions.decide(moe, Kernels(cuda=True, transformer_engine=True, te_version=(2, 3)))
    assert old_te["moe_permute_fusion"] and not old_te["moe_router_fusion"]  # router fusion needs TE 2.7
    assert not any(fusions.decide(moe, CPU).values())
    assert not any(fusions.decide(_cfg("train.fusions.rope=false"), GPU)[f] for f in ("apply_rope_fusion",))


def test_a_required_fusion_this_machine_lacks_is_an_error():
    with pytest.raises(RecipeError) as err:
        fusions.decide(_cfg("train.fusions.gradient_accumulation=true", "train.fusions.rope=true"), CPU)
    assert "train.fusions.gradient_accumulation=true: no GPU" in str(err.value)
    assert "train.fusions.rope=true" in str(err.value)
    local_spec_gpu = Kernels(cuda=True, transformer_engine=False)
    with pytest.raises(RecipeError, match="apex"):
        fusions.decide(_cfg("train.fusions.gradient_accumulation=true"), local_spec_gpu)


def test_a_gpu_machine_builds_its_config_with_the_fusions_on(monkeypatch):
    from megatron_recipes.models import builder, capabilities

    monkeypatch.setattr(capabilities, "kernels", lambda machine=None: GPU)
    monkeypatch.setattr(capabilities, "use_transformer_engine", lambda machine=None: True)
    config = builder.transformer_config_for(_cfg("train.fusions.rope=false"))
    assert config.gradient_accumulation_fusion and config.bias_dropout_fusion and config.bias_activation_fusion


def test_the_cpu_lane_trains_with_every_fusion_off():
    from megatron_recipes.models.builder import transformer_config_for

    config = transformer_config_for(_cfg())
    assert not any(getattr(config, f) for f in fusions.FIELDS.values())


def test_fp4_uses_megatron_cores_element_format():
    config = _gpu_config(_cfg("precision=nvfp4", "train.fusions.rope=false"))
    assert (config.fp4, config.fp4_recipe) == ("e2m1", "nvfp4")  # megatron-core types fp4 as Literal['e2m1']


def test_fp8_delayed_scaling_keeps_an_amax_history():
    config = _gpu_config(_cfg("precision=fp8_delayed"))
    assert (config.fp8, config.fp8_recipe) == ("hybrid", "delayed")
    assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo) == (1024, "max")
    current = _gpu_config(_cfg("precision=fp8_tensorwise"))
    assert current.fp8_amax_history_len == 1  # current scaling keeps no history


def test_single_node_ranks_set_cuda_device_max_connections(monkeypatch):
    """A rank started without a job script (train, run_single_node.sh, torchrun) sets it before CUDA."""
    from megatron_recipes.training import cli, loop

    seen = {}
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(loop, "run", lambda cfg, recipe, validated=False: seen.setdefault("value", cli.os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")) and 0)
    cfg = compose_recipe("llama3_8b_pretrain", [])
    cli.run_rank("llama3_8b_pretrain", cfg)  # TP=2 on H100: megatron-core overlaps TP communication
    assert seen["value"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    seen.clear()
    cli.run_rank("llama3_8b_pretrain", cfg)
    assert seen["value"] == "4", "a value the user set is kept"
    env = {}
    assert cli.set_rank_environment(_cfg(), env) == [] and env == {}  # CPU lane: nothing to set


def test_versions_name_the_whole_stack():
    from megatron_recipes.runtime import versions

    stack = versions.stack()
    assert set(stack) == {"megatron-core", "transformer-engine", "torch", "cuda"}
    assert stack["megatron-core"].startswith("0.") and stack["torch"]


def test_packed_sft_with_several_rows_per_micro_batch_is_refused_where_te_runs():
    """tiny_llama_sft declares a CPU cluster (mbs 4 is fine on the local spec), but started on a GPU
    machine with Transformer Engine it would hand TE several packed rows at once: refused there."""
    from megatron_recipes.models.capabilities import Machine, unmet_requirements

    cfg = compose_recipe("tiny_llama_sft", ["data.sft_path=train.jsonl"])
    hopper = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0))
    cpu = Machine(cuda=False, transformer_engine=False, deep_ep=False, compute_capability=(0, 0))
    assert any("train.micro_batch_size=1" in p for p in unmet_requirements(cfg, hopper))
    assert not unmet_requirements(cfg, cpu)
    one_row = compose_recipe("tiny_llama_sft", ["data.sft_path=train.jsonl", "train.micro_batch_size=1"])
    assert not unmet_requirements(one_row, hopper)


def test_deterministic_runs_reach_megatron_cores_deterministic_mode():
    """benchmarks/gpu_check.py compares runs bit for bit with train.deterministic=true; megatron-core only
    chooses its deterministic code (embedding backward, TE attention's guard) from deterministic_mode."""
    assert _gpu_config(_cfg("train.deterministic=true")).deterministic_mode is True
    assert _gpu_config(_cfg()).deterministic_mode is False


@pytest.mark.parametrize(
    "overrides, reuse",
    [
        (("precision=mxfp8", "precision.fp8_param_gather=true"), True),
        (("precision=mxfp8", "precision.fp8_param_gather=true", "parallel.fsdp=true"), False),  # FSDP keeps its own buffers
        (("precision=mxfp8",), False),  # parameters stay bf16: no FP8 gather
        (("precision=fp8_delayed", "precision.fp8_param_gather=true"), False),  # only MXFP8 tensors refuse the remap
    ],
)
def test_mxfp8_param_gather_shares_the_grad_buffer_as_megatron_core_requires(overrides, reuse):
    """megatron-core lays MXFP8 params over the grad buffer under the distributed optimizer and, without
    reuse_grad_buf_for_mxfp8_param_ag, remaps them through TE's replace_raw_data, which MXFP8 refuses: a crash
    at wrapping on Blackwell. Both configs are megatron-core's own (their validation runs)."""
    from megatron_recipes.training import optim

    cfg = _cfg("optimizer.use_distributed_optimizer=true", *overrides)
    ddp, opt = optim.ddp_config(cfg), optim.optimizer_config(cfg)
    assert ddp.reuse_grad_buf_for_mxfp8_param_ag is reuse and opt.reuse_grad_buf_for_mxfp8_param_ag is reuse
    assert ddp.fp8_param_gather is cfg.precision.fp8_param_gather
