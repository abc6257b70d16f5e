"""Machine rules (scope ``machine``): what the machine a run starts on can honour. Filled in below."""

from __future__ import annotations

MACHINE_RULES: list = []
