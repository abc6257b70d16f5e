"""Name tables shared by the mixture-of-experts families (not a family itself)."""

from megatron_recipes.families.family import hf_layer, layer_table
from megatron_recipes.families.transforms import Copy, Gated


def routed_experts(router: str, expert: str, gate: str, up: str, down: str):
    """Router + routed experts of one MoE layer; ``expert`` is the HF prefix holding ``{expert}``."""
    return layer_table(
        {
            "pre_mlp_layernorm.weight": Copy(hf_layer("post_attention_layernorm.weight")),
            "mlp.router.weight": Copy(hf_layer(router)),
            "mlp.experts.experts.linear_fc1.weight": Gated(hf_layer(f"{expert}.{gate}"), hf_layer(f"{expert}.{up}")),
            "mlp.experts.experts.linear_fc2.weight": Copy(hf_layer(f"{expert}.{down}")),
        }
    )
