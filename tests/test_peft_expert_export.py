"""LoRA on routed and shared experts, trained at EP=2, leaves as an HF PEFT adapter equal to the merged export.

For each MoE family (Mixtral; Qwen3-MoE with a dense first layer; DeepSeek-V3 with a dense first layer
and a shared expert) a random tiny HF model is imported, LoRA on attention, dense/shared-expert MLP and
routed-expert linears trains two steps at EP=2 on two gloo ranks and saves, and ``convert export`` writes
the adapter (``adapter_only=true``) and the merged model. transformers 5 + peft load the adapter on the
original HF model (its experts are fused 3D parameters, adapted through ``target_parameters``): its logits
must equal the merged export's and the trained model's within 1e-4, and each expert's factors in the fused
tensors must be the ones its EP rank trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import peft_support as ps

pytestmark = pytest.mark.slow

TOL = 1e-4
STEPS, RANK = 2, 8
EXPERTS = 4  # every family's tiny config
# family -> (tiny HF config overrides, peft.target_modules, extra overrides)
CASES = {
    "mixtral": ({}, ["linear_qkv", "linear_proj", "expert_fc1", "expert_fc2"], ["peft.dropout=0.1"]),
    "qwen3_moe": ({"mlp_only_layers": [0]}, ["linear_qkv", "linear_fc1", "linear_fc2", "expert_fc1", "expert_fc2"], []),
    # MLA: the rule table offers no attention linears; MTP layers take no adapters (left out: they need labels)
    "deepseek_v3": ({"num_nextn_predict_layers": 0}, ["linear_fc1", "linear_fc2", "expert_fc1", "expert_fc2"], []),
}


def _import(root: str, family: str) -> dict:
    from convert_support import make_hf_model
    from megatron_recipes.config.schema import ParallelConfig
    from megatron_recipes.convert.importer import run_import

    hf = make_hf_model(family, Path(root) / "hf", **CASES[family][0])
    report = run_import(hf, Path(root) / "base", ParallelConfig(), dtype="fp32", progress=False)
    return {"hf": str(hf), "base": str(report.out_dir), "model": report.cfg.model.name}


def _expert_adapters(chunks) -> dict:
    """This rank's routed-expert adapters by layout-free name (``layers.<L>.mlp.experts.<global e>.linear_fc1``)."""
    from megatron_recipes.peft.lora import LoRALinear

    return {m.name: (m.lora_a.detach().clone(), m.lora_b.detach().clone())
            for chunk in chunks for m in chunk.modules() if isinstance(m, LoRALinear) and ".experts." in m.name}


def _train(run: str, imported: dict, family: str):
    _, targets, extra = CASES[family]
    return ps.train_and_save(
        2, run, imported["base"], STEPS, f"hydra.searchpath=[file://{imported['base']}]", f"model={imported['model']}",
        "parallel.ep=2", "parallel.moe_dispatcher=allgather", "peft.method=lora", f"peft.rank={RANK}",
        f"peft.target_modules=[{','.join(targets)}]", *extra, inspect=_expert_adapters,
    )


def _export(root: str, run: str, verify: bool) -> dict:
    """Adapter and merged exports through the CLI; the trained model's own logits (one rank, EP=1)."""
    import contextlib
    import io

    from megatron_recipes.convert.cli import main
    from megatron_recipes.convert.peft_export import load_trained
    from megatron_recipes.convert.verify import forward_logits, prompt_tokens
    from megatron_recipes.runtime.distributed import shutdown

    ckpt = f"ckpt_dir={run}/checkpoints"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["export", ckpt, f"hf_dir={root}/adapter", "adapter_only=true", "--verify" if verify else "--no-verify"]) == 0
    assert main(["export", ckpt, f"hf_dir={root}/merged", "--quiet", "--no-verify"]) == 0
    cfg, chunks, _ = load_trained(Path(run) / "checkpoints")
    tokens = prompt_tokens(cfg.model.vocab_size)
    logits = forward_logits(cfg, chunks, tokens)
    shutdown()
    return {"tokens": tokens, "logits": logits, "printed": printed.getvalue()}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"expert-export-{family}")
    imported = ps.run_ranks(1, _import, str(root), family)[0]
    ranks = ps.run_ranks(2, _train, str(root / "run"), imported, family)
    out = ps.run_ranks(1, _export, str(root), str(root / "run"), family == "deepseek_v3")[0]  # the CLI's own check once
    return family, root, imported, ranks, out


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _logits(model, tokens, vocab):
    with torch.no_grad():
        return model(tokens).logits[..., :vocab]


def test_adapter_on_hf_model_equals_merged_export(exported):
    from peft import PeftModel

    family, root, imported, ranks, out = exported
    tokens, vocab = out["tokens"], _hf(imported["hf"]).config.vocab_size
    ours = out["logits"][..., :vocab]
    adapted = PeftModel.from_pretrained(_hf(imported["hf"]), str(root / "adapter")).eval()
    theirs = _logits(adapted, tokens, vocab)
    merged = _logits(_hf(root / "merged"), tokens, vocab)
    plain = _logits(_hf(imported["hf"]), tokens, vocab)
    assert float((theirs - merged).abs().max()) <= TOL, f"{family}: adapter vs merged {float((theirs - merged).abs().max())}"
    assert float((theirs - ours).abs().max()) <= TOL, f"{family}: adapter vs trained {float((theirs - ours).abs().max())}"
    assert float((plain - ours).abs().max()) > 100 * TOL  # the adapters changed the model: the checks can fail
    for losses, _ in ranks:
        assert losses[0] != losses[-1] and losses == ranks[0][0]


def test_adapter_config_targets_fused_experts(exported):
    family, root, _, _, out = exported
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    moe_layers = range(1, 4) if family != "mixtral" else range(4)
    fused = {f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in ("gate_up_proj", "down_proj")}
    mlp = {"qwen3_moe": {"model.layers.0.mlp.{}.weight"},
           "deepseek_v3": {"model.layers.0.mlp.{}.weight"} | {f"model.layers.{i}.mlp.shared_experts.{{}}.weight" for i in moe_layers},
           "mixtral": set()}[family]
    dense = {name.format(leaf) for name in mlp for leaf in ("gate_proj", "up_proj", "down_proj")}
    assert set(config["target_parameters"]) == fused | dense
    attention = {"mixtral": {"q_proj", "k_proj", "v_proj", "o_proj"}, "qwen3_moe": {"q_proj", "k_proj", "v_proj"},
                 "deepseek_v3": set()}[family]
    assert set(config["target_modules"]) == attention  # no MLP names: HF PEFT would rewrite them into the experts
    assert config["r"] == RANK and config["use_dora"] is False
    assert config["lora_dropout"] == 0.0
    assert ("lora_dropout is written as 0" in out["printed"]) == (family == "mixtral")


def test_ep2_experts_gathered_into_fused_tensors(exported):
    """Each expert's A/B in the fused tensors is what the EP rank that held that expert trained."""
    from safetensors.torch import load_file

    _, root, _, ranks, _ = exported
    tensors = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    trained = [adapters for _, adapters in ranks]
    assert trained[0] and trained[1] and not set(trained[0]) & set(trained[1])  # EP=2: each rank its own experts
    # each rank trained experts of its own (DeepSeek's group-limited routing may leave a group without tokens)
    assert all(any(b.abs().sum() > 0 for _, b in adapters.values()) for adapters in trained)
    seen = 0
    for name, (a, b) in {**trained[0], **trained[1]}.items():
        layer, expert, linear = name.split(".")[1], int(name.split(".")[4]), name.rsplit(".", 1)[-1]
        inner = ".base_layer" if linear == "linear_fc1" else ""  # gate_up_proj is wrapped first, down_proj around it
        key = f"base_model.model.model.layers.{layer}.mlp.experts{inner}"
        fused_a, fused_b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
        assert torch.equal(fused_a.view(EXPERTS, RANK, -1)[expert], a), name
        assert torch.equal(fused_b.view(-1, RANK, EXPERTS)[:, :, expert], b), name
        seen += 1
    assert seen == 2 * EXPERTS * len({n.split(".")[1] for n in trained[0]})


def test_unexpressible_adapters_are_refused_before_loading():
    """DoRA on parameter targets has no HF PEFT form; attention-only DoRA still exports; dropout is noted."""
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.convert.peft_experts import check_expressible, parameter_targets

    moe = ["model=tiny_moe", "peft.target_modules=[linear_qkv,expert_fc1]"]
    with pytest.raises(RecipeError) as err:
        check_expressible(ps.tiny_cfg(1, *moe, "peft.method=dora"), {})
    assert "DoRA" in err.value.render() and "merged" in err.value.render()
    assert check_expressible(ps.tiny_cfg(1, "model=tiny_moe", "peft.method=dora", "peft.target_modules=[linear_qkv]"), {}) == []
    notes = check_expressible(ps.tiny_cfg(1, *moe, "peft.method=lora", "peft.dropout=0.1"), {})
    assert any("lora_dropout is written as 0" in n for n in notes)
    deepseek = ps.tiny_cfg(1, "model=deepseek_v3", "peft.method=lora", "peft.target_modules=[linear_fc1,expert_fc2]")
    assert parameter_targets(deepseek, {"rope_interleave": True}) == ["linear_fc1", "expert_fc2"]
