"""Progress where people wait: a rich bar on a terminal, plain periodic lines elsewhere (CI, Slurm logs).

One helper for every long command (conversion, layout search, preprocessing, checks). Work that ends
within ``delay`` seconds shows nothing; a bar or lines appear only once the wait is noticeable. Lines go
to stderr so a command's stdout (``--json``) stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

DELAY_S = 1.5  # nothing is shown for work shorter than this
INTERVAL_S = 10.0  # one plain line per interval when not on a terminal
QUIET_S = 60.0  # ... but while nothing moves, only one per this many seconds (a sign of life, not a log flood)


def human(n: float, unit: str = "B") -> str:
    """``1234567`` bytes -> ``1.23 MB`` (decimal units, as transfer rates are quoted)."""
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.0f} {prefix}B" if prefix == "" else f"{n:.2f} {prefix}B"
        n /= 1000
    return f"{n:.2f} PB"


def count(n: float) -> str:
    """``1839872`` -> ``1.84M``: a count's short form (tables, headlines)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def parameters(n: float, note: str = "") -> str:
    """The one way a parameter count is written in prose: exact, and short (``1,839,872 parameters (1.84M)``)."""
    return f"{int(n):,} parameters ({count(n)}{'; ' + note if note else ''})"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Counts one amount (``total`` in ``unit``: bytes, documents, layouts) and optionally items beside it.

    ``with Progress("import", total=nbytes, unit="B", items_total=n, items_unit="tensors") as p:
    p.update(nbytes_done_now, items=1)``; ``total=None`` when the amount is not known in advance.
    """

    def __init__(
        self,
        desc: str,
        total: Optional[float] = None,
        unit: str = "",
        items_total: Optional[int] = None,
        items_unit: str = "",
        enabled: bool = True,
        stream: Optional[TextIO] = None,
        interval: Optional[float] = None,
        delay: Optional[float] = None,
        clock: Callable[[], float] = time.monotonic,
        tty: Optional[bool] = None,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.items_total, self.items_unit = items_total, items_unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = INTERVAL_S if interval is None else interval
        self.delay = DELAY_S if delay is None else delay
        self.clock = clock
        self.done, self.items = 0.0, 0
        self.start = clock()
        self.last_line: Optional[float] = None
        self.last_done: Optional[float] = None
        self.bar = None

    # ----- counting ------------------------------------------------------------------------------
    def update(self, n: float = 0, items: int = 0) -> None:
        self.done += n
        self.items += items
        if not self.enabled:
            return
        now = self.clock()
        if now - self.start < self.delay:
            return
        if self.tty:
            self._bar_update()
        elif self.last_line is None or now - self.last_line >= (self.interval if self.done != self.last_done else QUIET_S):
            self.last_line, self.last_done = now, self.done
            self._print(self.line(now))

    def line(self, now: Optional[float] = None) -> str:
        """``import: 41% 1.23 GB / 3.00 GB, 120 / 291 tensors, 35.0 MB/s, ETA 51 s``."""
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        parts = []
        amount = (lambda v: human(v, "B")) if self.unit == "B" else (lambda v: f"{v:,.0f}")
        suffix = "" if self.unit in ("", "B") else f" {self.unit}"
        if self.total:
            parts.append(f"{100 * self.done / self.total:.0f}% {amount(self.done)} / {amount(self.total)}{suffix}")
        else:
            parts.append(f"{amount(self.done)}{suffix}")
        if self.items_unit:
            of = f" / {self.items_total:,}" if self.items_total else ""
            parts.append(f"{self.items:,}{of} {self.items_unit}")
        parts.append(f"{human(rate, 'B')}/s" if self.unit == "B" else f"{rate:,.1f}{suffix or ' '}/s")
        if self.total and rate > 0 and self.done < self.total:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        return f"{self.desc}: " + ", ".join(parts)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    # ----- the terminal bar ------------------------------------------------------------------------
    def _bar_update(self) -> None:
        if self.bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

            self.bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[detail]}"), TimeRemainingColumn(),
                console=Console(file=self.stream, force_terminal=True), transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task(self.desc, total=self.total, detail="")
        detail = self.line()[len(self.desc) + 2 :]
        self.bar.update(self.task, completed=self.done, detail=detail.split(", ETA")[0])

    # ----- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self.bar is not None:
            self._bar_update()
            self.bar.stop()
            self.bar = None
        elif self.enabled and not self.tty and self.last_line is not None:
            elapsed = self.clock() - self.start
            items = f", {self.items:,} {self.items_unit}" if self.items_unit else ""
            amount = human(self.done, "B") if self.unit == "B" else f"{self.done:,.0f} {self.unit}".rstrip()
            self._print(f"{self.desc}: done, {amount}{items} in {duration(elapsed)}")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
