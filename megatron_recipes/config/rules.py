"""The validation rule table: every static check a recipe must pass before anything starts.

Each entry is a ``Rule`` (id, fields, check, message, fix), grouped by concern in ``rules_*.py``.
``validate.py`` runs the table. Checks that need the machine a run lands on (is Transformer Engine
importable, is DeepEP installed) belong to the trainer; these compare the recipe with the cluster it
declares.
"""

from __future__ import annotations

from typing import Dict, List

from megatron_recipes.config.rules_base import Rule
from megatron_recipes.config.rules_cp import CP_RULES
from megatron_recipes.config.rules_data import DATA_RULES
from megatron_recipes.config.rules_layout import LAYOUT_RULES
from megatron_recipes.config.rules_memory import MEMORY_RULES
from megatron_recipes.config.rules_model import MODEL_RULES
from megatron_recipes.config.rules_moe import MOE_RULES
from megatron_recipes.config.rules_peft import PEFT_RULES
from megatron_recipes.config.rules_precision import PRECISION_RULES
from megatron_recipes.config.rules_sharding import SHARDING_RULES
from megatron_recipes.config.rules_train import TRAIN_RULES
from megatron_recipes.config.rules_values import VALUE_RULES

# Single values first (a newline or a NaN makes every later message misleading); memory last: it only
# speaks once the layout it estimates is otherwise valid.
RULES: List[Rule] = (
    VALUE_RULES + LAYOUT_RULES + CP_RULES + MODEL_RULES + MOE_RULES + PRECISION_RULES + TRAIN_RULES + SHARDING_RULES
    + DATA_RULES + PEFT_RULES + MEMORY_RULES
)


def rules_by_id() -> Dict[str, Rule]:
    table = {r.id: r for r in RULES}
    if len(table) != len(RULES):  # a duplicated id would hide a rule from its tests
        dupes = sorted({r.id for r in RULES if sum(x.id == r.id for x in RULES) > 1})
        raise RuntimeError(f"duplicate rule ids in the rule table: {dupes}")
    return table


__all__ = ["Rule", "RULES", "rules_by_id"]
