"""A PEFT run leaves the cluster as merged HF weights or an HF PEFT adapter, both equal to what trained.

A random tiny HF Llama is imported; LoRA and DoRA adapters are trained at TP=2 and saved (adapter-only
checkpoints); ``megatron-recipes convert export`` writes the merged model and, with ``adapter_only=true``,
the adapter folder. ``transformers`` + ``peft`` load them in this process and their logits are compared
with our model's (base + adapters, rebuilt from the checkpoints in a child process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import peft_support as ps

pytestmark = pytest.mark.slow

TOL = 1e-4


def _export_job(root: str, run: str, method: str):
    """Export via the CLI (base, adapter, merged) and return the trained model's logits and fused LoRA (TP=1)."""
    from megatron_recipes.convert.cli import main
    from megatron_recipes.convert.verify import forward_logits, prompt_tokens
    from megatron_recipes.convert.peft_export import load_trained
    from megatron_recipes.runtime.distributed import shutdown

    ckpt = f"ckpt_dir={run}/checkpoints"
    check = ["--verify"] if method == "lora" else ["--no-verify"]  # the CLI's own logits check, once
    assert main(["export", f"ckpt_dir={root}/base", f"hf_dir={root}/base_hf_{method}", "--quiet", "--no-verify"]) == 0
    assert main(["export", ckpt, f"hf_dir={root}/adapter_{method}", "adapter_only=true", *check]) == 0
    assert main(["export", ckpt, f"hf_dir={root}/merged_{method}", "--quiet", *check]) == 0
    cfg, chunks, _ = load_trained(Path(run) / "checkpoints")
    tokens = prompt_tokens(cfg.model.vocab_size)
    logits = forward_logits(cfg, chunks, tokens)
    qkv = chunks[0].decoder.layers[1].self_attention.linear_qkv
    fused = {"lora_a": qkv.lora_a.detach().clone(), "lora_b": qkv.lora_b.detach().clone()}
    shutdown()
    return tokens, logits, fused


def _cli_error(args):
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.convert.cli import main

    try:
        main(args)
    except RecipeError as exc:
        return exc.render()
    return None


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-export")
    base = ps.run_ranks(1, ps.import_hf_llama, str(root))[0]
    runs = {}
    for method, world in (("lora", 2), ("dora", 1)):  # LoRA at TP=2: the export reshards it to one rank
        run = root / f"run_{method}"
        ps.run_ranks(world, ps.train_and_save, world, str(run), base, 3, f"parallel.tp={world}", f"peft.method={method}")
        runs[method] = run
    exports = {m: ps.run_ranks(1, _export_job, str(root), str(runs[m]), m)[0] for m in runs}
    return root, runs, exports


def _hf(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _max_abs(a, b):
    return float((a - b).abs().max())


def test_checkpoints_hold_adapters_only(env):
    from megatron_recipes.convert.dcp_io import CheckpointReader
    from megatron_recipes.checkpoint import latest

    _, runs, _ = env
    keys = [k for k in CheckpointReader(latest(runs["lora"] / "checkpoints")).tensors() if not k.startswith("optimizer")]
    assert keys and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in keys), keys[:8]
    dora = CheckpointReader(latest(runs["dora"] / "checkpoints")).tensors()
    assert any(k.endswith("magnitude") for k in dora)


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_adapter_on_exported_base_matches_our_model(env, method):
    from peft import PeftModel

    root, _, exports = env
    out, base_hf = root / f"adapter_{method}", root / f"base_hf_{method}"
    tokens, ours, fused = exports[method]

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["lora_alpha"] == 32.0
    assert config["use_dora"] == (method == "dora")
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    from safetensors.torch import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    layer = "base_model.model.model.layers.1."
    shapes = {n: tuple(tensors[layer + n].shape) for n in ("self_attn.q_proj.lora_B.weight", "self_attn.k_proj.lora_B.weight",
                                                           "mlp.gate_proj.lora_B.weight", "mlp.down_proj.lora_A.weight")}
    assert shapes == {"self_attn.q_proj.lora_B.weight": (128, 16), "self_attn.k_proj.lora_B.weight": (64, 16),
                      "mlp.gate_proj.lora_B.weight": (384, 16), "mlp.down_proj.lora_A.weight": (16, 384)}
    # megatron's fused QKV rows are [q_g0 (2 heads), k_g0, v_g0, q_g1, k_g1, v_g1] (32 rows per head)
    b = fused["lora_b"].view(2, 4, 32, 16)
    assert torch.equal(tensors[layer + "self_attn.q_proj.lora_B.weight"], b[:, :2].reshape(128, 16))
    assert torch.equal(tensors[layer + "self_attn.k_proj.lora_B.weight"], b[:, 2].reshape(64, 16))
    assert torch.equal(tensors[layer + "self_attn.v_proj.lora_B.weight"], b[:, 3].reshape(64, 16))
    assert torch.equal(tensors[layer + "self_attn.v_proj.lora_A.weight"], fused["lora_a"])
    assert any(k.endswith("lora_magnitude_vector") for k in tensors) == (method == "dora")

    model = PeftModel.from_pretrained(_hf(base_hf), str(out)).eval()
    with torch.no_grad():
        theirs = model(tokens).logits
    assert _max_abs(theirs, ours) <= TOL, _max_abs(theirs, ours)
    with torch.no_grad():
        plain = _hf(base_hf)(tokens).logits
    assert _max_abs(plain, ours) > 100 * TOL  # the adapters changed the model: the check can fail


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_merged_export_matches_our_model(env, method):
    root, _, exports = env
    out = root / f"merged_{method}"
    tokens, ours, _ = exports[method]
    assert not (out / "adapter_config.json").exists()
    with torch.no_grad():
        theirs = _hf(out)(tokens).logits
    assert _max_abs(theirs, ours) <= TOL, _max_abs(theirs, ours)


def test_export_errors(env):
    root, runs, _ = env
    ckpt = f"ckpt_dir={runs['lora']}/checkpoints"
    errors = ps.run_ranks(
        1,
        _errors,
        [
            ["export", f"ckpt_dir={root}/base", f"hf_dir={root}/x1", "adapter_only=true"],
            ["export", ckpt, f"hf_dir={root}/x2", "adapter_only=maybe"],
            ["export", ckpt, f"hf_dir={root}/hf", "adapter_only=true"],
        ],
    )[0]
    assert "not from a PEFT run" in errors[0]
    assert "adapter_only=maybe" in errors[1]
    assert "already exists" in errors[2]
    assert not (root / "x1").exists() and not (root / "x2").exists()


def _errors(arg_lists):
    return [_cli_error(args) for args in arg_lists]
