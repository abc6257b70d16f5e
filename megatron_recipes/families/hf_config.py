"""HF ``config.json`` <-> recipe ``ModelConfig``: the pieces every family shares.

A family's mapping file combines these (dense core, RoPE, MoE router) and adds its own fields. HF configs
are read through transformers' own config classes (``AutoConfig``, never remote code), so defaults and
the v4 ``rope_theta``/``rope_scaling`` vs v5 ``rope_parameters`` spellings are resolved the library's way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import ModelConfig, RopeScalingConfig


def load_hf_config(hf_dir: Path):
    """The HF config object of a local folder; never runs remote code, never touches the network."""
    from transformers import AutoConfig

    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise RecipeError(f"{hf_dir} has no config.json", fix="point hf_dir= at a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise RecipeError(f"{path} is not valid JSON ({exc})", fix="restore the model's config.json (re-download or re-save it)") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path} holds a JSON {type(raw).__name__}, not an object", fix="restore the model's config.json")
    model_type = raw.get("model_type")
    _check_sizes(raw, path)
    try:
        hf = AutoConfig.from_pretrained(str(hf_dir), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError) as exc:
        raise RecipeError(
            f"{path}: transformers cannot read model_type={model_type!r} without remote code ({exc})",
            fix="convert a model whose architecture transformers ships (see `megatron-recipes convert --help`)",
        ) from None
    except Exception as exc:  # noqa: BLE001 (transformers' own field validation: a value of the wrong type)
        raise RecipeError(f"{path}: transformers rejects it: {' '.join(str(exc).split())}",
                          fix="restore the model's config.json (re-download or re-save it)") from None
    return hf


# Sizes every family divides by or allocates with: each a whole number > 0 when present (a 0 head count
# was a ZeroDivisionError, a negative hidden size a model that passed every check)
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
          "vocab_size", "head_dim", "moe_intermediate_size", "num_local_experts", "num_experts", "n_routed_experts",
          "num_experts_per_tok", "max_position_embeddings")


def _check_sizes(raw: Dict[str, Any], path: Path) -> None:
    bad = [f"{key}={raw[key]!r}" for key in _SIZES
           if raw.get(key) is not None and (isinstance(raw[key], bool) or not isinstance(raw[key], int) or raw[key] < 1)]
    if bad:
        raise RecipeError(f"{path}: {', '.join(bad)}: each must be a whole number > 0",
                          fix="restore the model's config.json (re-download or re-save it)")


def _get(hf, name: str, default: Any = None) -> Any:
    value = getattr(hf, name, default)
    return default if value is None else value


# Each RoPE scaling type mapped, with its fields beyond factor and original_max_position_embeddings
# (the same names in HF ``rope_scaling``/``rope_parameters`` and in ``RopeScalingConfig``).
SCALING_FIELDS = {"llama3": ("low_freq_factor", "high_freq_factor"), "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")}


def rope_parameters(hf) -> Dict[str, Any]:
    """RoPE settings in one dict, from transformers v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = getattr(hf, "rope_parameters", None)
    if params and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        raise RecipeError("per-layer-type RoPE parameters are not supported", fix="convert a model with one RoPE setting")
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", _get(hf, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_from_hf(hf) -> Dict[str, Any]:
    p = rope_parameters(hf)
    out: Dict[str, Any] = {"rotary_base": float(p["rope_theta"]), "rope_scaling": None}
    kind = p["rope_type"]
    if kind != "default":
        if kind not in SCALING_FIELDS:
            raise RecipeError(
                f"HF rope_type={kind!r} has no megatron-core equivalent here",
                fix="supported RoPE types: default, llama3 (Llama 3.1), yarn (DeepSeek-V3)",
            )
        defaults = RopeScalingConfig()  # for the optional fields HF may leave out
        out["rope_scaling"] = RopeScalingConfig(
            rope_type=kind,
            factor=float(p["factor"]),
            original_max_position_embeddings=int(p["original_max_position_embeddings"]),
            **{f: float(p.get(f, getattr(defaults, f))) for f in SCALING_FIELDS[kind]},
        )
    if float(_get(hf, "partial_rotary_factor", 1.0)) != 1.0:
        raise RecipeError("partial_rotary_factor != 1 is not supported", fix="convert a model with full rotary dims")
    return out


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def rope_to_hf(m: ModelConfig) -> Dict[str, Any]:
    """RoPE kwargs in the installed transformers' spelling (v5 ``rope_parameters``, v4 ``rope_theta``/``rope_scaling``)."""
    scaling = _rope_scaling_to_hf(m)
    if transformers_major() >= 5:
        return {"rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": m.rotary_base}}
    return {"rope_theta": m.rotary_base, "rope_scaling": scaling}


def _rope_scaling_to_hf(m: ModelConfig) -> Optional[Dict[str, Any]]:
    rs = m.rope_scaling
    if rs is None:
        return None
    if rs.rope_type not in SCALING_FIELDS:
        raise RecipeError(f"model.rope_scaling.rope_type={rs.rope_type!r} has no HF equivalent here", fix="use llama3 or yarn")
    fields = ("factor", "original_max_position_embeddings") + SCALING_FIELDS[rs.rope_type]
    return {"rope_type": rs.rope_type, **{f: getattr(rs, f) for f in fields}}


def _activation(hf) -> str:
    act = _get(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise RecipeError(f"HF hidden_act={act!r} is not supported for gated MLPs", fix="families here use SiLU-gated MLPs")
    return "swiglu"


def dense_from_hf(hf) -> Dict[str, Any]:
    """The transformer core every family here shares: sizes, RMSNorm, SwiGLU, RoPE, embeddings."""
    heads = hf.num_attention_heads
    head_dim = _get(hf, "head_dim", hf.hidden_size // heads)
    out: Dict[str, Any] = dict(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        num_query_groups=_get(hf, "num_key_value_heads", heads),
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        kv_channels=head_dim if head_dim != hf.hidden_size // heads else None,
        normalization="RMSNorm",
        norm_epsilon=float(hf.rms_norm_eps),
        activation=_activation(hf),
        position_embedding_type="rope",
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        init_method_std=float(_get(hf, "initializer_range", 0.02)),
    )
    out.update(rope_from_hf(hf))
    return out


def dense_to_hf(m: ModelConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = dict(
        num_hidden_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        intermediate_size=m.ffn_hidden_size,
        vocab_size=m.vocab_size,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=m.tie_embeddings,
        initializer_range=m.init_method_std,
    )
    if m.kv_channels:  # otherwise hidden_size // heads, which every config class derives itself
        out["head_dim"] = m.kv_channels
    out.update(rope_to_hf(m))
    return out


def require(hf, name: str, expected: Any, why: str) -> None:
    """Refuse HF settings megatron-core cannot reproduce, naming the field."""
    value = getattr(hf, name, expected)
    if value != expected:
        raise RecipeError(f"HF config {name}={value!r} is not supported ({why})", fix=f"only {name}={expected!r} converts")


def sliding_window_from_hf(hf, enabled: Optional[bool] = None) -> Optional[int]:
    window = _get(hf, "sliding_window", None)
    if enabled is False:
        return None
    return int(window) if window else None
