"""Line charts as inline SVG text: the report opens anywhere, with no script and no network.

Each drawn series is one ``<polyline class="series" data-n=...>``, so a test (or a person reading the
DOM) can tell an empty chart from a drawn one.
"""

from __future__ import annotations

import math
from html import escape
from typing import List, Optional, Sequence, Tuple

Points = Sequence[Tuple[float, float]]
COLORS = ("#1f6fb5", "#e07b00", "#2a9d3f", "#c0392b")
W, H = 520, 280
LEFT, RIGHT, TOP, BOTTOM = 64, 14, 30, 40


def ticks(lo: float, hi: float, n: int = 5) -> List[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out, v = [], first
    while v <= hi + step * 1e-9:
        out.append(round(v, 12))
        v += step
    return out


def fmt(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.4g}M"
    if a >= 1e4:
        return f"{v / 1e3:.4g}k"
    if 0 < a < 1e-2:
        return f"{v:.1e}"
    return f"{v:.4g}"


def _range(values: List[float]) -> Tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def line_chart(
    title: str,
    series: Sequence[Tuple[str, Points]],
    y_label: str,
    baseline: Optional[Tuple[str, float]] = None,
) -> str:
    """One SVG chart of step (x) against a metric (y); series with one point get a marker."""
    drawn = [(label, list(pts)) for label, pts in series if pts]
    head = f'<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{escape(title)}">'
    parts = [head, f'<text x="{W / 2}" y="18" class="title">{escape(title)}</text>']
    if not drawn:
        parts.append(f'<text x="{W / 2}" y="{H / 2}" class="empty">no data logged yet</text></svg>')
        return "".join(parts)
    xs = [x for _, pts in drawn for x, _ in pts]
    ys = [y for _, pts in drawn for _, y in pts] + ([baseline[1]] if baseline else [])
    (x0, x1), (y0, y1) = (min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1), _range(ys)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + (1 - (y - y0) / (y1 - y0)) * ph

    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" class="plot"/>')
    for t in ticks(y0, y1):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" class="grid"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" class="ytick">{fmt(t)}</text>')
    for t in ticks(x0, x1):
        parts.append(f'<text x="{px(t):.1f}" y="{TOP + ph + 16}" class="xtick">{fmt(t)}</text>')
    parts.append(f'<text x="{LEFT + pw / 2}" y="{H - 6}" class="xlabel">step</text>')
    parts.append(f'<text x="14" y="{TOP + ph / 2}" class="ylabel" transform="rotate(-90 14 {TOP + ph / 2})">{escape(y_label)}</text>')
    if baseline:
        y = py(baseline[1])
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" class="baseline"/>')
    legend = []
    for i, (label, pts) in enumerate(drawn):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" data-n="{len(pts)}" points="{coords}" stroke="{color}"/>')
        if len(pts) <= 30:
            parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>' for x, y in pts)
        legend.append((label, color, ""))
    if baseline:
        legend.append((baseline[0], "#888", ' stroke-dasharray="5 4"'))
    for i, (label, color, dash) in enumerate(legend):
        ly = TOP + 12 + 15 * i
        parts.append(f'<line x1="{LEFT + pw - 170}" x2="{LEFT + pw - 150}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>')
        parts.append(f'<text x="{LEFT + pw - 145}" y="{ly + 4}" class="legend">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)
