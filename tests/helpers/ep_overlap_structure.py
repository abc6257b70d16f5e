"""(subprocess of test_ep_overlap.py) EP communication overlap as a GPU run with Transformer Engine configures it.

Installs the transformer_engine import stub first (this interpreter only), then for each case (a JSON
``[recipe, [override, ...], [override without virtual stages, ...]]``):
1. the rule table (recipe and machine scopes) on an H100 with Transformer Engine 2.9;
2. megatron-core's ``TransformerConfig`` built by the project's one mapping for that machine (fusions decided
   for it), with megatron-core's own validation in ``__post_init__``; and the same recipe without virtual
   stages, which megatron-core must refuse (the overlap lives in its interleaved schedule);
3. the DDP config the trainer wraps the model with, and the TE decoder block spec (the MoE layers' experts).
Prints one JSON object: {"<recipe>": {"error": str|None, ...}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import te_stub  # noqa: E402

te_stub.install()

from te_structure import _module_at, _name  # noqa: E402  (the TE structure test's spec readers)


def _config(cfg):
    from megatron_recipes.models import fusions
    from megatron_recipes.models.fusions import Kernels
    from megatron_recipes.models.transformer_config import build_transformer_config

    decided = fusions.decide(cfg, Kernels(cuda=True, transformer_engine=True, te_version=(2, 9)))
    return build_transformer_config(cfg, use_te=True, cpu_init=False, fusions=decided)


def check(recipe: str, overrides, without_vpp):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.models import builder
    from megatron_recipes.models.capabilities import Machine
    from megatron_recipes.training import optim
    from megatron_recipes.validation.rules import Host, select
    from megatron_recipes.validation.validate import validate

    cfg = compose_recipe(recipe, list(overrides))
    h100 = Machine(cuda=True, transformer_engine=True, deep_ep=False, compute_capability=(9, 0), te_version=(2, 9))
    violations = [v.rule_id for v in validate(cfg, rules=select(("recipe", "machine")), host=Host(machine=h100))]
    config = _config(cfg)
    refused = None
    try:
        _config(compose_recipe(recipe, [*overrides, *without_vpp]))
    except RecipeError as exc:
        refused = str(exc)
    ddp = optim.ddp_config(cfg)
    parallel_state.set_pipeline_model_parallel_world_size(cfg.parallel.pp)
    parallel_state.set_pipeline_model_parallel_rank(0)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(cfg.parallel.vpp)
    spec = builder.layer_spec(cfg, config, vp_stage=0 if cfg.parallel.vpp else None, pp_rank=0, use_te=True)
    linear = _module_at(spec.layer_specs[0], "self_attention.linear_qkv") or _module_at(
        spec.layer_specs[0], "self_attention.linear_q_proj"
    )
    every_layer = get_gpt_decoder_layer_specs(config, use_transformer_engine=True, normalization=cfg.model.normalization)
    moe = next((s for s in every_layer if _name(_module_at(s, "mlp")) == "MoELayer"), None)
    return {
        "error": None,
        "violations": violations,
        "overlap": config.overlap_moe_expert_parallel_comm,
        "delay_wgrad_compute": config.delay_wgrad_compute,
        "ddp_delay_wgrad_compute": ddp.delay_wgrad_compute,
        "vpp": config.virtual_pipeline_model_parallel_size,
        "recipe_vpp": cfg.parallel.vpp,
        "legacy_grouped_gemm": bool(getattr(config, "moe_use_legacy_grouped_gemm", False)),
        "dispatcher": config.moe_token_dispatcher_type,
        "experts": _name(_module_at(moe, "mlp.experts")) if moe is not None else None,
        "spec": getattr(linear, "__name__", str(linear)),
        "refused_without_vpp": refused,
    }


def main(cases):
    out = {}
    for case in cases:
        recipe, overrides, without_vpp = json.loads(case)
        try:
            out[recipe] = check(recipe, overrides, without_vpp)
        except Exception as exc:  # reported per case; the test names each failure
            out[recipe] = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
