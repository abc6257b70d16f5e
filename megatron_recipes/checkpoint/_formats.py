"""Which on-disk format the distributed optimizer's state is saved in, and why (said once per run).

``checkpoint.optimizer_format=auto`` (the default): ``dp_reshardable`` where the fully_reshardable gather
is large (``estimate/checkpoint_cost.py``: host memory or time on DP rank 0), because that gather runs on
every save; else ``fully_reshardable``, which resumes at any layout. A run that resumed from a checkpoint
saved at another layout saves ``fully_reshardable`` whatever its size: it is being moved, and
its next move should not be refused. An explicit format is used as asked.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

log = logging.getLogger(__name__)

FORMATS = ("fully_reshardable", "dp_reshardable")
CHOICES = ("auto",) + FORMATS
_RESUMED_AT_ANOTHER_LAYOUT: list = []  # [description] once this process resumed a checkpoint of another layout
_SAID: set = set()


def note_resharded_resume(saved: str, now: str) -> None:
    """Called by ``load`` when the checkpoint's layout differs from this run's."""
    _RESUMED_AT_ANOTHER_LAYOUT[:] = [f"resumed from a checkpoint saved at {saved}, now {now}"]


def choose(cfg: RunConfig) -> Tuple[str, str]:
    """(format, why) for this run's saves."""
    fmt = cfg.checkpoint.optimizer_format
    if fmt not in CHOICES:
        raise RecipeError(
            f"checkpoint.optimizer_format={fmt!r} is not known",
            fix=f"use {', '.join(CHOICES)} (fully_reshardable resumes in any layout)",
        )
    if fmt != "auto":
        return fmt, "checkpoint.optimizer_format asks for it"
    if _RESUMED_AT_ANOTHER_LAYOUT:
        return "fully_reshardable", f"auto: this run {_RESUMED_AT_ANOTHER_LAYOUT[0]}"
    from megatron_recipes.estimate.checkpoint_cost import optimizer_gather

    cost = optimizer_gather(cfg)
    size = f"{cost.host_bytes / 1e9:.1f} GB on DP rank 0, ~{cost.seconds:.0f} s over gloo per save"
    if cost.large:
        return "dp_reshardable", f"auto: the fully_reshardable gather would be large ({size})"
    return "fully_reshardable", f"auto: the fully_reshardable gather is small ({size})"


def say_once(fmt: str, why: str, rank: Optional[int]) -> None:
    if (fmt, why) in _SAID:
        return
    _SAID.add((fmt, why))
    if rank == 0:
        print(f"checkpoint optimizer format: {fmt} ({why})", flush=True)
    log.info("checkpoint optimizer format: %s (%s)", fmt, why)
