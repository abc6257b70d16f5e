"""Per-step numbers of two runs side by side, and the verdict: equal within tolerance, or where they part.

Pure functions over lists of floats, so the verdict logic is tested without starting any process.

Tolerance at step k (counted from the seed checkpoint): k x ``rtol``. A correct layout changes only the
order of float32 sums (TP splits contractions, DP/EP sum gradients in another order), so each step adds a
rounding difference of about one step's size (``rtol``, 1e-5 by default, bounds step 1), and the weights
carry it into every later step, the resumed ones included. Under the check's Adam-as-SGD update (lr * g,
which adds rounding and never amplifies it) these per-step differences add up: at most linearly in the
number of updates. A deep shrunk layout (Llama-3-70B: 20 layers in PP2 x VPP5 chunks, TP2, CP2) was seen at 1.36e-5
in its resumed steps; a wrong layout parts by far more at step 1 (a wrong pipeline split, per-layout
dropout masks: > 1e-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass
class Series:
    """One metric of two runs over the same steps (``first_step`` is the step number of index 0)."""

    name: str
    got: List[float]
    ref: List[float]
    first_step: int = 1


@dataclass
class Verdict:
    equal: bool
    first_diverging_step: Optional[int]  # None when equal (or when a run logged too few steps)
    metric: Optional[str]
    reason: str


def relative_diff(x: float, y: float) -> float:
    if not (math.isfinite(x) and math.isfinite(y)):
        return math.inf
    return abs(x - y) / max(abs(y), 1e-12)


def judge(series: Sequence[Series], rtol: float) -> Verdict:
    """Equal when every metric has the same number of steps and each step k is within k * ``rtol`` (relative)."""
    first: Optional[tuple] = None
    for s in series:
        if len(s.got) != len(s.ref) or not s.ref:
            return Verdict(False, None, s.name, f"{s.name}: {len(s.got)} step(s) logged, expected {len(s.ref)}")
        for i, (x, y) in enumerate(zip(s.got, s.ref)):
            step = s.first_step + i
            if not relative_diff(x, y) <= rtol * step:
                if first is None or step < first[0]:
                    first = (step, s.name, x, y)
                break
    if first is None:
        return Verdict(True, None, None, f"every step k equal within k x {rtol:g} relative")
    step, name, x, y = first
    return Verdict(False, step, name, f"{name} parts at step {step}: {x:.8g} vs {y:.8g} (relative {relative_diff(x, y):.2e} > {step} x {rtol:g})")


def table(series: Sequence[Series], got_label: str, ref_label: str) -> str:
    """A text table: step, then for each metric the two values and their relative difference."""
    steps = max(len(s.ref) for s in series)
    first = min(s.first_step for s in series)
    head = ["step"] + [f"{s.name} {lab}" for s in series for lab in (got_label, ref_label, "rel.diff")]
    rows = [head]
    for k in range(steps):
        row = [str(first + k)]
        for s in series:
            i = first + k - s.first_step
            if 0 <= i < len(s.ref):
                x = s.got[i] if i < len(s.got) else math.nan
                row += [f"{x:.8g}", f"{s.ref[i]:.8g}", f"{relative_diff(x, s.ref[i]):.1e}" if i < len(s.got) else "missing"]
            else:
                row += ["", "", ""]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows)
