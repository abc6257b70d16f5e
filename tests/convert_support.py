"""Tiny random HF models of every convertible family, built locally from transformers' config classes.

Each family's module declares its tiny config (``Family.tiny_hf_config``): small (4 layers, hidden 64)
but exercising what its mapping must get right: GQA (2 query groups under 4 heads), llama3 RoPE scaling,
a sliding window shorter than the prompt, QKV biases with tied embeddings, q/k norms with an explicit
head_dim, experts, MLA with YaRN and a shared expert, a multi-token-prediction layer. Norm weights, biases and buffers are randomised
here, since HF initialises them to 1/0 and a swapped norm would otherwise go unnoticed. Vocabulary sizes
force padding. The tests loop over ``FAMILIES``, so a new family is covered without editing them.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Dict

import torch

from megatron_recipes.families import FAMILIES, by_name  # every listed family; each carries its tiny HF config


def hf_config(family: str, **overrides):
    return by_name(family).tiny_hf_config(**overrides)


MOE = tuple(f for f in FAMILIES if by_name(f).config_from_hf(hf_config(f)).get("num_moe_experts"))  # tested with EP=2


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
    if getattr(model.config, "num_nextn_predict_layers", 0):  # MTP layers, which transformers does not build
        from mtp_support import add_mtp_layers

        add_mtp_layers(family, folder, model, seed, dtype, **overrides)
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
