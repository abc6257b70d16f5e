"""Stop cleanly when the scheduler is about to take the nodes away, so a requeued job resumes.

Two ways a stop is requested, because a signal reaches only some processes: Slurm's
``--signal=B:USR1@300`` goes to the batch shell alone, whose trap touches a flag file
(``<run.dir>/PREEMPT``); a ``SIGTERM``/``SIGUSR1`` delivered to a rank itself sets an in-process flag.
``requested(step)`` folds both into one answer agreed by every rank (a one-element ``all_reduce(MAX)``),
so all ranks stop at the same step and the checkpoint they write together is complete.

The trainer's contract: ``clear_marker()`` at start; each step ``if watcher.requested(step)``: save a
checkpoint, ``mark_preempted(step)``, exit 0. The batch script sees ``preempted.json`` and requeues.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

from megatron_recipes import files
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.run_files import MARKER_NAME

FLAG_FILE_ENV = "MEGATRON_RECIPES_PREEMPT_FILE"
FLAG_NAME = "PREEMPT"

# Reason codes, ordered so that all_reduce(MAX) keeps the most specific one any rank saw.
_NONE, _FILE, _SIGNAL = 0, 1, 2


def _signal_number(name: str) -> signal.Signals:
    """'USR1', 'SIGUSR1' or '10' -> signal.SIGUSR1; a typo is an error, not a silently ignored signal."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise RecipeError(
            f"unknown signal '{name}' for preemption",
            fix="use a signal name such as USR1, USR2 or TERM (cluster.preempt_signal)",
        ) from None


def _dist_ready():
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist_ready()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


class PreemptionWatcher:
    """Signal handlers + flag file -> one stop decision shared by all ranks."""

    def __init__(
        self,
        run_dir: Path | str,
        signals: Sequence[str] = ("SIGUSR1", "SIGTERM"),
        check_every: int = 1,
    ):
        if check_every < 1:
            raise RecipeError(f"check_every={check_every} must be >= 1", fix="check the flag every step: 1")
        self.run_dir = Path(run_dir)
        self.flag_file = Path(os.environ.get(FLAG_FILE_ENV) or self.run_dir / FLAG_NAME)
        self.marker_file = self.run_dir / MARKER_NAME
        self.signals = [_signal_number(s) for s in signals]
        self.check_every = check_every
        self._got_signal: Optional[signal.Signals] = None
        self._previous: Dict[signal.Signals, object] = {}
        self._reason: Optional[str] = None

    # -- signals -------------------------------------------------------------------------------
    def install(self) -> "PreemptionWatcher":
        """Install handlers that only record the signal (safe to run at any point of a step)."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, _frame) -> None:
        self._got_signal = signal.Signals(signum)

    # -- decision ------------------------------------------------------------------------------
    def _local_code(self) -> int:
        if self._got_signal is not None:
            return _SIGNAL
        return _FILE if self.flag_file.exists() else _NONE

    def requested(self, step: int) -> bool:
        """True on every rank, at the same step, once any rank got a signal or the flag file exists.

        Checks only every ``check_every`` steps; all ranks must call it with the same step numbers
        (it runs a collective when torch.distributed is initialised).
        """
        if step % self.check_every:
            return False
        local = self._local_code()
        code = local
        dist = _dist_ready()
        if dist is not None and dist.get_world_size() > 1:
            code = self._agree(local)
        if code == _NONE:
            return False
        if local == _SIGNAL:
            self._reason = f"signal {self._got_signal.name}"
        elif local == _FILE:
            self._reason = f"flag file {self.flag_file}"
        else:
            self._reason = "requested by another rank"
        return True

    @staticmethod
    def _agree(code: int) -> int:
        from megatron_recipes.runtime import collectives

        return int(collectives.all_reduce_values([code], op="max")[0])

    @property
    def reason(self) -> Optional[str]:
        return self._reason

    # -- markers -------------------------------------------------------------------------------
    def mark_preempted(self, step: int) -> None:
        """Rank 0: record where the run stopped (the batch script requeues on it) and consume the flag."""
        if _rank() != 0:
            return
        record = {
            "step": int(step),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "reason": self._reason or "requested",
            "host": socket.gethostname(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        }
        files.write_text(self.marker_file, json.dumps(record, indent=2) + "\n")
        self.flag_file.unlink(missing_ok=True)

    def clear_marker(self) -> None:
        """At the start of a run: forget the previous run's marker.

        The flag file is deliberately kept: a signal may arrive while this run is still starting up,
        and the batch script already removed any stale flag before it launched the ranks.
        """
        if _rank() == 0:
            self.marker_file.unlink(missing_ok=True)

