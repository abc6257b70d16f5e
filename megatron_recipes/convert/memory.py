"""Peak resident memory of a conversion, measured over the conversion alone.

``ru_maxrss`` only grows over a process's life (imports, model building), so it cannot isolate one
phase. On Linux the kernel's high-water mark can be reset (``/proc/self/clear_refs``, value 5) and read
back (``VmHWM``); elsewhere a background thread samples RSS with psutil.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def rss() -> int:
    return psutil.Process().memory_info().rss


def _hwm() -> Optional[int]:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


@dataclass
class Peak:
    baseline: int = 0  # RSS when the measurement started
    peak: int = 0  # highest RSS seen while it ran

    @property
    def over_baseline(self) -> int:
        return max(0, self.peak - self.baseline)


class PeakRss:
    """``with PeakRss() as p: ...`` then ``p.result``: baseline and peak RSS of the block."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.result = Peak()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._kernel = False

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.result.peak = max(self.result.peak, rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakRss":
        self.result.baseline = rss()
        self.result.peak = self.result.baseline
        self._kernel = _reset_hwm() and _hwm() is not None
        if not self._kernel:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._kernel:
            self.result.peak = max(self.result.peak, _hwm() or 0)
        else:
            self._stop.set()
            if self._thread:
                self._thread.join()
        self.result.peak = max(self.result.peak, rss())


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
