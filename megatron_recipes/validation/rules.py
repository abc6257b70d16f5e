"""The validation rule table: every static check a recipe must pass before anything starts.

Each entry is a ``Rule`` (id, fields, check, message, fix, scope), grouped by concern in ``rules_*.py``.
``validate.py`` runs the table; a command picks the rules it judges with ``select`` (by scope: the recipe
against the cluster it declares, the inputs a run reads, Slurm settings, the machine the run starts on).
"""

from __future__ import annotations

from typing import Dict, Iterable, List

from megatron_recipes.validation.rules_base import DEFAULT_SCOPES, SCOPES, Host, Rule
from megatron_recipes.validation.rules_cp import CP_RULES
from megatron_recipes.validation.rules_data import DATA_RULES
from megatron_recipes.validation.rules_ep_overlap import EP_OVERLAP_MACHINE_RULES, EP_OVERLAP_RULES
from megatron_recipes.validation.rules_launch import LAUNCH_RULES
from megatron_recipes.validation.rules_layout import LAYOUT_RULES
from megatron_recipes.validation.rules_machine import MACHINE_RULES
from megatron_recipes.validation.rules_memory import MEMORY_RULES
from megatron_recipes.validation.rules_model import MODEL_RULES
from megatron_recipes.validation.rules_moe import MOE_RULES
from megatron_recipes.validation.rules_peft import PEFT_RULES
from megatron_recipes.validation.rules_precision import PRECISION_RULES
from megatron_recipes.validation.rules_recompute import RECOMPUTE_MACHINE_RULES, RECOMPUTE_RULES
from megatron_recipes.validation.rules_sharding import SHARDING_RULES
from megatron_recipes.validation.rules_train import TRAIN_RULES
from megatron_recipes.validation.rules_values import VALUE_RULES

# Single values first (a newline or a NaN makes every later message misleading); memory last: it only
# speaks once the layout it estimates is otherwise valid.
RULES: List[Rule] = (
    VALUE_RULES + LAYOUT_RULES + CP_RULES + MODEL_RULES + MOE_RULES + EP_OVERLAP_RULES + PRECISION_RULES + TRAIN_RULES
    + RECOMPUTE_RULES + SHARDING_RULES + DATA_RULES + PEFT_RULES + MEMORY_RULES + LAUNCH_RULES + MACHINE_RULES
    + EP_OVERLAP_MACHINE_RULES + RECOMPUTE_MACHINE_RULES
)


def select(scopes: Iterable[str] = DEFAULT_SCOPES, provided: Iterable[str] = (), model_layout: bool = False) -> List[Rule]:
    """The rules a command judges, in table order: those of ``scopes``, minus input rules whose input the
    command brings itself (``provided``, e.g. `check`'s own seed checkpoint); ``model_layout`` keeps only
    the rules on the model and its layout (what a conversion target must meet)."""
    scopes, provided = set(scopes), set(provided)
    unknown = scopes - set(SCOPES)
    if unknown:
        raise ValueError(f"unknown rule scope(s) {sorted(unknown)}; scopes are {sorted(SCOPES)}")
    return [r for r in RULES if r.scope in scopes and r.needs not in provided and (r.model_layout or not model_layout)]


def rules_by_id() -> Dict[str, Rule]:
    table = {r.id: r for r in RULES}
    if len(table) != len(RULES):  # a duplicated id would hide a rule from its tests
        dupes = sorted({r.id for r in RULES if sum(x.id == r.id for x in RULES) > 1})
        raise RuntimeError(f"duplicate rule ids in the rule table: {dupes}")
    return table


__all__ = ["Host", "Rule", "RULES", "SCOPES", "rules_by_id", "select"]
