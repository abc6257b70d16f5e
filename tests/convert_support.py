"""Tiny random HF models of every convertible family, built locally from transformers' config classes.

Each model is small (4 layers, hidden 64) but exercises what its family's mapping must get right: GQA
(2 query groups under 4 heads), llama3 RoPE scaling, a sliding window shorter than the prompt, QKV
biases with tied embeddings, q/k norms with an explicit head_dim, experts, MLA with YaRN and a shared
expert. Norm weights, biases and buffers are randomised, since HF initialises them to 1/0 and a
swapped norm would otherwise go unnoticed. Vocabulary sizes force padding.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Dict

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")

_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256)


def hf_config(family: str, **overrides):
    import transformers as T

    gqa = dict(_COMMON, num_key_value_heads=2)
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        cls, kw = T.LlamaConfig, dict(vocab_size=1000, rope_parameters=rope, **gqa)
    elif family == "mistral":
        cls, kw = T.MistralConfig, dict(vocab_size=1100, sliding_window=5, **gqa)
    elif family == "qwen2":
        cls, kw = T.Qwen2Config, dict(vocab_size=1000, tie_word_embeddings=True, **gqa)
    elif family == "qwen3":
        cls, kw = T.Qwen3Config, dict(vocab_size=1000, head_dim=32, **gqa)
    elif family == "mixtral":
        cls, kw = T.MixtralConfig, dict(vocab_size=1000, num_local_experts=4, num_experts_per_tok=2, **gqa)
    elif family == "qwen3_moe":
        cls, kw = T.Qwen3MoeConfig, dict(vocab_size=1000, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16, **gqa)
    elif family == "deepseek_v3":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        cls, kw = T.DeepseekV3Config, dict(
            vocab_size=1000, num_key_value_heads=4, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_parameters=yarn, **_COMMON,
        )
    else:
        raise ValueError(family)
    return cls(**{**kw, **overrides})


def make_hf_model(family: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a random ``family`` model (safetensors + config.json) into ``folder``; ``overrides`` go to its config."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides)).to(dtype)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and ("norm" in name or "bias" in name):
                tensor.add_(torch.randn_like(tensor) * 0.2)
    model.save_pretrained(str(folder))
    return folder


def load_safetensors(folder: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(path))
    return out


def assert_same_tensors(original: Path, exported: Path) -> None:
    """Bit-identical: same names, dtypes, shapes and bytes."""
    a, b = load_safetensors(original), load_safetensors(exported)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    different = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensor(s) differ, e.g. {different[:5]}"


def config_differences(original: Path, exported: Path) -> Dict[str, tuple]:
    """Fields of config.json that differ, apart from the writing library's version."""
    a = json.loads((original / "config.json").read_text())
    b = json.loads((exported / "config.json").read_text())
    keys = (set(a) | set(b)) - {"transformers_version"}
    return {k: (a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)}
