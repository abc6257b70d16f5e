"""The project's user-facing error type: what is wrong, and how to fix it.

Raised for bad recipes, data, checkpoints and CLI arguments; the CLI prints it and exits non-zero
without a traceback. Never replaced by ``assert`` (which vanishes under ``python -O``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


class RecipeError(Exception):
    """A single problem with user input, carrying a suggested fix."""

    def __init__(self, message: str, fix: Optional[str] = None):
        self.message = message
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        return f"{self.message}\n  fix: {self.fix}" if self.fix else self.message


@dataclass
class Violation:
    """One broken validation rule, as reported to the user."""

    rule_id: str
    fields: List[str]
    message: str
    fix: str

    def render(self) -> str:
        return f"[{self.rule_id}] {', '.join(self.fields)}: {self.message}\n      fix: {self.fix}"


class ValidationError(RecipeError):
    """Every violated rule of a recipe, reported together."""

    def __init__(self, violations: List[Violation], recipe: str = "recipe"):
        self.violations = violations
        lines = [f"{recipe}: {len(violations)} validation rule(s) violated:"]
        lines += ["  " + v.render() for v in violations]
        super().__init__("\n".join(lines))

    def render(self) -> str:  # the message already holds the fixes
        return self.message
