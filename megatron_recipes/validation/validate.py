"""Run the rule table over a composed recipe: every violated rule, reported together.

By default the recipe and input scopes (what `train` judges before any rank starts); commands pass their
own selection (``rules.select``) and, for the launch and machine scopes, the ``Host`` they run on.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

from megatron_recipes.config.errors import ValidationError, Violation
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.validation.rules import Rule, rules_by_id, select
from megatron_recipes.validation.rules_base import Host, degrees_ok


def validate(cfg: RunConfig, rules: Optional[Iterable[Rule]] = None, skip: Iterable[str] = (),
             host: Optional[Host] = None) -> List[Violation]:
    """Violations of ``rules`` (default: the recipe and input scopes), in table order; empty when valid."""
    skipped = set(skip)
    host = host or Host()
    out: List[Violation] = []
    for r in select() if rules is None else rules:
        if r.id in skipped:
            continue
        try:
            message = r.run(cfg, host)
        except (ZeroDivisionError, ValueError, TypeError) as exc:
            if not degrees_ok(cfg):
                continue  # layout.degrees_positive already names the zero/negative degree
            message = f"could not be checked: {exc}"
        if message:
            out.append(Violation(rule_id=r.id, fields=list(r.fields), message=message, fix=r.fix_text(cfg)))
    return out


def validate_or_raise(cfg: RunConfig, recipe_name: str = "recipe", rules: Optional[Iterable[Rule]] = None,
                      host: Optional[Host] = None) -> None:
    """Raise one ``ValidationError`` listing every violated rule of ``rules`` (never an ``assert``)."""
    violations = validate(cfg, rules=rules, host=host)
    if violations:
        raise ValidationError(violations, recipe=recipe_name)


def require(cfg: RunConfig, *rule_ids: str) -> None:
    """Raise the named rules' violations: a builder reachable without ``validate`` (tests, conversion)
    asks the table for the rules on the fields it maps instead of repeating their allowed values."""
    table = rules_by_id()
    validate_or_raise(cfg, "recipe", rules=[table[i] for i in rule_ids])
