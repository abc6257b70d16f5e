"""``peft.method`` strings -> what to build, and the module names adapters can target.

One place decides which adapter types combine; the rule table and ``peft/`` both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_recipes.config.errors import RecipeError

METHODS = ("none", "lora", "dora", "qlora", "ptuning")
# megatron-core module names as recipes give them in peft.target_modules (expert_*: routed experts)
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "expert_fc1", "expert_fc2")
COMBINATIONS = {
    frozenset(["none"]): "none",
    frozenset(["lora"]): "lora",
    frozenset(["dora"]): "dora",
    frozenset(["qlora"]): "qlora",
    frozenset(["ptuning"]): "ptuning",
    frozenset(["qlora", "dora"]): "qlora+dora",
}


@dataclass(frozen=True)
class Method:
    none: bool = False
    lora: bool = False  # any low-rank adapter on linears (lora, dora, qlora)
    dora: bool = False
    quantize: bool = False
    prefix: bool = False


def why_not(method: str) -> str | None:
    """``None`` when ``method`` is valid, else the reason (used by the rule table and ``parse``)."""
    parts = [p.strip() for p in str(method).split("+")]
    unknown = [p for p in parts if p not in METHODS]
    if unknown:
        return f"peft.method={method!r}: unknown method(s) {unknown}; known: {', '.join(METHODS)}"
    if len(set(parts)) != len(parts) or frozenset(parts) not in COMBINATIONS:
        allowed = ", ".join(sorted(COMBINATIONS.values()))
        return (
            f"peft.method={method!r} mixes adapter types that cannot combine "
            f"(a LoRA-family adapter is one of lora/dora/qlora; P-Tuning v2 stands alone); use one of: {allowed}"
        )
    return None


def parse(method: str) -> Method:
    problem = why_not(method)
    if problem:
        raise RecipeError(problem, fix="set peft.method to one of the listed values")
    parts = set(p.strip() for p in method.split("+"))
    return Method(
        none=parts == {"none"},
        lora=bool(parts & {"lora", "dora", "qlora"}),
        dora="dora" in parts,
        quantize="qlora" in parts,
        prefix="ptuning" in parts,
    )
