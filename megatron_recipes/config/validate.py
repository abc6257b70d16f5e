"""Run the rule table over a composed recipe: every violated rule, reported together."""

from __future__ import annotations

from typing import Iterable, List, Optional

from megatron_recipes.config.errors import ValidationError, Violation
from megatron_recipes.config.rules import RULES, Rule
from megatron_recipes.config.rules_base import degrees_ok
from megatron_recipes.config.schema import RunConfig


def validate(cfg: RunConfig, rules: Optional[Iterable[Rule]] = None, skip: Iterable[str] = ()) -> List[Violation]:
    """Violations of ``rules`` (default: the whole table), in table order; empty when the recipe is valid."""
    skipped = set(skip)
    out: List[Violation] = []
    for r in RULES if rules is None else rules:
        if r.id in skipped:
            continue
        try:
            message = r.check(cfg)
        except (ZeroDivisionError, ValueError, TypeError) as exc:
            if not degrees_ok(cfg):
                continue  # layout.degrees_positive already names the zero/negative degree
            message = f"could not be checked: {exc}"
        if message:
            out.append(Violation(rule_id=r.id, fields=list(r.fields), message=message, fix=r.fix_text(cfg)))
    return out


def validate_or_raise(cfg: RunConfig, recipe_name: str = "recipe", skip: Iterable[str] = ()) -> None:
    """Raise one ``ValidationError`` listing every violated rule (never an ``assert``)."""
    violations = validate(cfg, skip=skip)
    if violations:
        raise ValidationError(violations, recipe=recipe_name)
