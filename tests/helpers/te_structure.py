"""(subprocess of test_te_structure.py) TE configs and layer specs of every recipe x precision, as a GPU run.

Installs the transformer_engine import stub first (this interpreter only), then for each case:
1. megatron-core's ``TransformerConfig`` built by the project's one mapping for a GPU machine with
   Transformer Engine (fusions decided for it: all the kernels present), with megatron-core's own
   validation running in ``__post_init__``;
2. the TE decoder block spec (first pipeline stage / first virtual chunk) next to the local spec the CPU
   lane builds, compared layer by layer: where the TE spec fuses a norm into the next linear
   (``IdentityOp`` in the norm's place, a ``TELayerNormColumnParallelLinear`` after it), the local spec
   must store that norm under the linear's ``layer_norm_`` keys; where TE keeps a separate norm, the local
   spec must keep its own name. Either mismatch means a CPU-lane or CPU-converted checkpoint would not
   load into the TE model.
Prints one JSON object: {"<recipe>/<precision>": {"error": str|None, "fusions": [...], "spec": str}}.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).parent))
import te_stub  # noqa: E402

te_stub.install()

# (norm attribute in the layer, the linear TE fuses it into, where that linear lives)
FUSABLE = [
    ("input_layernorm", "self_attention.linear_qkv"),
    ("pre_mlp_layernorm", "mlp.linear_fc1"),
    ("self_attention.q_layernorm", "self_attention.linear_q_up_proj"),
    ("self_attention.kv_layernorm", "self_attention.linear_kv_up_proj"),
]


def _submodules(node):
    """A spec entry's submodules; 0.18 on, MoE layers are a functools.partial carrying them as a keyword."""
    if isinstance(node, functools.partial):
        return node.keywords.get("submodules")
    return getattr(node, "submodules", None)


def _module_at(spec, path: str):
    node = spec
    for part in path.split("."):
        sub = _submodules(node)
        if sub is None or not hasattr(sub, part):
            return None
        node = getattr(sub, part)
    return getattr(node, "module", node)


def _name(module) -> Optional[str]:
    """The class a spec entry builds, by name (0.18 on it may be a functools.partial of it)."""
    from megatron_recipes.runtime.mcore_compat import built_class

    built = built_class(module)
    return built.__name__ if built is not None else None


def _compare_layer(te_layer, local_layer, index: int):
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    problems = []
    keys = dict(getattr(local_layer.submodules, "sharded_state_dict_keys_map", {}) or {})
    for norm, linear in FUSABLE:
        te_norm = _module_at(te_layer, norm)
        if te_norm is None:
            continue
        fused = te_norm is IdentityOp or (isinstance(te_norm, type) and issubclass(te_norm, IdentityOp))
        mapped = keys.get(f"{norm.rpartition('.')[2] if '.' in norm else norm}.") or keys.get(f"{norm}.")
        te_linear = _module_at(te_layer, linear)
        if fused and te_linear is None:
            continue  # no norm at all here (e.g. q_layernorm of a model without qk norms)
        if fused:
            if not (isinstance(te_linear, type) and issubclass(te_linear, TELayerNormColumnParallelLinear)):
                problems.append(f"layer {index}: TE drops {norm} but {linear} is {te_linear}, not a fused-norm linear")
            elif mapped != f"{linear}.layer_norm_":
                problems.append(f"layer {index}: TE stores {norm} as {linear}.layer_norm_*, the local spec as {mapped or norm}")
        elif mapped:
            problems.append(f"layer {index}: TE keeps {norm} separate, the local spec renames it to {mapped}")
    return problems


def check(recipe: str, precision: str, extra=()):
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.models import builder, fusions
    from megatron_recipes.models.fusions import Kernels
    from megatron_recipes.models.transformer_config import build_transformer_config

    cfg = compose_recipe(recipe, [f"precision={precision}", *extra])
    decided = fusions.decide(cfg, Kernels(cuda=True, transformer_engine=True, te_version=(2, 9)))
    config = build_transformer_config(cfg, use_te=True, cpu_init=False, fusions=decided)
    vp = 0 if cfg.parallel.vpp else None
    # a pipeline layout is read for the rank parallel_state names (megatron-core ignores pp_rank then): rank 0
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_world_size(cfg.parallel.pp)
    parallel_state.set_pipeline_model_parallel_rank(0)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(cfg.parallel.vpp)
    te_spec = builder.layer_spec(cfg, config, vp_stage=vp, pp_rank=0, use_te=True)
    local_spec = builder.layer_spec(cfg, config, vp_stage=vp, pp_rank=0, use_te=False)
    assert len(te_spec.layer_specs) == len(local_spec.layer_specs) > 0
    problems = []
    for i, (te_layer, local_layer) in enumerate(zip(te_spec.layer_specs, local_spec.layer_specs)):
        problems += _compare_layer(te_layer, local_layer, i)
    linear = _module_at(te_spec.layer_specs[0], "self_attention.linear_qkv") or _module_at(
        te_spec.layer_specs[0], "self_attention.linear_q_proj"
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    every_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=True, normalization=cfg.model.normalization)
    moe = next((spec for spec in every_layer if _name(_module_at(spec, "mlp")) == "MoELayer"), None)  # any stage
    return {
        "dispatcher": getattr(config, "moe_token_dispatcher_type", None),
        "flex_backend": getattr(config, "moe_flex_dispatcher_backend", None),
        "experts": _name(_module_at(moe, "mlp.experts")) if moe is not None else None,
        "error": "; ".join(problems) or None,
        "fusions": sorted(k for k, v in decided.items() if v),
        "spec": getattr(linear, "__name__", str(linear)),
        "fp8": config.fp8,
        "fp4": config.fp4,
        "recompute_granularity": config.recompute_granularity,
        "recompute_modules": config.recompute_modules,
    }


def main(cases):
    from megatron.core import parallel_state  # noqa: F401  (imports megatron-core after the stub)

    out = {}
    for case in cases:
        recipe, precision, *extra = case.split("/")  # recipe/precision[/override...]
        try:
            out[case] = check(recipe, precision, extra)
        except Exception as exc:  # reported per case; the test names each failure
            out[case] = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
