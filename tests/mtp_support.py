"""DeepSeek-V3's multi-token-prediction layers on the HF side, built from transformers' own modules.

transformers' ``DeepseekV3ForCausalLM`` builds no MTP layer (it ignores ``model.layers.<num_hidden_layers>.*``),
so a tiny model's MTP weights are made here in the layout DeepSeek-V3's checkpoint stores them: under
``model.layers.<N>.`` (N = num_hidden_layers + i) a decoder layer as transformers saves layer N of a model
with N + 1 layers, plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the model's
embedding (``embed_tokens``) and output head (``shared_head.head``). ``reference_mtp_logits`` runs them by
DeepSeek-V3's MTP formula on transformers' modules, loaded by transformers' own loader, not by our mapping.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict

import torch

OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def mtp_layers(config) -> range:
    first = config.num_hidden_layers
    return range(first, first + int(getattr(config, "num_nextn_predict_layers", 0) or 0))


def add_mtp_layers(family: str, folder: Path, model, seed: int, dtype: torch.dtype, **overrides) -> None:
    """Write ``model``'s MTP layers (random, norms around 1) into ``folder``'s safetensors file."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from convert_support import hf_config

    config = model.config
    layers = mtp_layers(config)
    torch.manual_seed(seed + 1)
    longer = AutoModelForCausalLM.from_config(hf_config(family, **{**overrides, "num_hidden_layers": layers.stop})).to(dtype)
    with torch.no_grad():
        for name, tensor in list(longer.named_parameters()) + list(longer.named_buffers()):
            if tensor.is_floating_point() and ("norm" in name or "bias" in name):
                tensor.add_(torch.randn_like(tensor) * 0.2)
    with tempfile.TemporaryDirectory() as tmp:
        longer.save_pretrained(tmp)  # transformers' own on-disk layout of a decoder layer (experts one by one)
        stored = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            stored.update(load_file(str(path)))
    (path,) = sorted(Path(folder).glob("*.safetensors"))  # the tiny model is one file
    tensors = load_file(str(path))
    h = config.hidden_size
    for i in layers:
        prefix = f"model.layers.{i}."
        tensors.update({k: v for k, v in stored.items() if k.startswith(prefix)})
        for norm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[prefix + norm] = (1 + 0.2 * torch.randn(h)).to(dtype)
        tensors[prefix + "eh_proj.weight"] = (0.02 * torch.randn(h, 2 * h)).to(dtype)
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _tensors(folder: Path) -> Dict[str, torch.Tensor]:
    from convert_support import load_safetensors

    return load_safetensors(folder)


@torch.no_grad()
def reference_mtp_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] logits of the first MTP layer at every position i, from the main model's last
    hidden state h_i (after its final norm) and the next token t_(i+1) (id 0 after the last position, as
    megatron-core rolls it in):

        logits_i = shared_head.head(shared_head.norm(TRM(eh_proj([enorm(embed(t_(i+1))); hnorm(h_i)]))))

    TRM is transformers' ``DeepseekV3DecoderLayer`` N (loaded by transformers from layer N's tensors, as a
    model with N + 1 layers), at the main model's positions, causal mask and rotary embedding. The concatenation
    puts the embedding first, as megatron-core's ``MultiTokenPredictionLayer`` does and as the servers that run
    DeepSeek-V3's released MTP weights do; the report's formula writes the two the other way round.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    (layer,) = mtp_layers(config)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    main = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
    longer = AutoModelForCausalLM.from_pretrained(str(folder), num_hidden_layers=layer + 1, **kwargs).eval()
    trm = longer.model.layers[layer]

    seen = {}
    last = main.model.layers[layer - 1]
    hook = last.register_forward_pre_hook(lambda module, args, kw: seen.update(kw), with_kwargs=True)
    try:
        hidden = main.model(tokens).last_hidden_state
    finally:
        hook.remove()

    weights = _tensors(folder)
    prefix = f"model.layers.{layer}."
    h, eps = config.hidden_size, config.rms_norm_eps

    def norm(name: str) -> DeepseekV3RMSNorm:
        module = DeepseekV3RMSNorm(h, eps=eps)
        module.weight.copy_(weights[prefix + name].float())
        return module

    enorm, hnorm, head_norm = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
    eh_proj = torch.nn.Linear(2 * h, h, bias=False)
    eh_proj.weight.copy_(weights[prefix + "eh_proj.weight"].float())
    embed = weights[prefix + "embed_tokens.weight"].float()
    head = weights[prefix + "shared_head.head.weight"].float()

    following = torch.roll(tokens, -1, dims=1)
    following[:, -1] = 0
    x = eh_proj(torch.cat([enorm(embed[following]), hnorm(hidden)], dim=-1))
    x = trm(x, attention_mask=seen.get("attention_mask"), position_ids=seen.get("position_ids"),
            position_embeddings=seen["position_embeddings"])
    return head_norm(x) @ head.T
