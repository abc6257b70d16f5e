"""What a model family's mapping file declares.

A family is data: HF architecture names, the HF config <-> ModelConfig functions, a name table from
megatron-core's checkpoint keys (TE naming, layer index dropped: ``decoder.layers.<name>``) to typed
transforms over HF tensor names with ``{layer}``/``{expert}`` placeholders, and a tiny HF config that the
tests build a random model from. One small file per family in this package declares one ``FAMILY``.

Multi-token-prediction layers (megatron-core's ``mtp.layers.<i>.``, index dropped: ``mtp.layers.<name>``)
count on after the decoder's: MTP layer ``i`` is ``{layer}`` = ``num_layers + i``, where HF DeepSeek-V3
stores it (``model.layers.61`` after 61 decoder layers). Each holds one decoder layer
(``mtp.layers.transformer_layer.<name>``), mapped by the decoder's own table (``mtp_layer_table``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Tuple

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ModelConfig
from megatron_recipes.families.transforms import Transform

LAYER = "decoder.layers."
MTP_LAYER = "mtp.layers."
MTP_DECODER_LAYER = MTP_LAYER + "transformer_layer."  # the decoder layer inside each MTP layer


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    architectures: Tuple[str, ...]  # HF ``architectures`` this file converts
    model_type: str  # HF ``model_type`` written on export
    weights: Mapping[str, Transform]  # canonical megatron key -> transform
    config_from_hf: Callable[[Any], Dict[str, Any]]  # HF config object -> ModelConfig fields
    config_to_hf: Callable[[ModelConfig], Dict[str, Any]]  # ModelConfig -> HF config kwargs
    # A tiny random-init HF config (transformers' own config class; ``**overrides`` go to it) that the
    # tests build a model of this family from: small, but with every feature this mapping must get right.
    tiny_hf_config: Callable[..., Any]
    flags_from_hf: Callable[[Any], Dict[str, Any]] = lambda hf: {}  # per-model switches the transforms read
    ignored_hf: Tuple[str, ...] = (r".*rotary_emb\.inv_freq$",)  # HF tensors that are not weights
    ignored_from_hf: Callable[[Any], Tuple[str, ...]] = lambda hf: ()  # skips that depend on the HF config
    notes: str = ""

    def transform(self, canonical_key: str) -> Transform:
        try:
            return self.weights[canonical_key]
        except KeyError:
            raise RecipeError(
                f"family {self.name!r} has no mapping for megatron tensor {canonical_key}",
                fix=f"add it to megatron_recipes/families/{self.name}.py (this model uses a feature the mapping does not cover)",
            ) from None

    def ignored(self, hf) -> Tuple[str, ...]:
        """Patterns of HF tensors this family deliberately does not convert."""
        return self.ignored_hf + tuple(self.ignored_from_hf(hf))


def layer_table(entries: Mapping[str, Transform]) -> Dict[str, Transform]:
    """Prefix a table of per-layer entries with ``decoder.layers.``."""
    return {LAYER + k: v for k, v in entries.items()}


def mtp_layer_table(decoder: Mapping[str, Transform], own: Mapping[str, Transform]) -> Dict[str, Transform]:
    """An MTP layer's entries: its ``own`` (norms, projection; keys without the ``mtp.layers.`` prefix) and its
    decoder layer, mapped as the ``decoder`` table maps a decoder layer (its HF names under the MTP layer's index)."""
    out = {MTP_LAYER + k: v for k, v in own.items()}
    out.update({MTP_DECODER_LAYER + k[len(LAYER):]: v for k, v in decoder.items() if k.startswith(LAYER)})
    return out


def hf_layer(template: str) -> str:
    """HF per-layer names: ``model.layers.{layer}.<template>``."""
    return "model.layers.{layer}." + template


# The shape every family's tiny test model shares (4 layers, hidden 64); each family adds its own features.
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256)
