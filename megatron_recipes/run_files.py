"""The files a run directory holds, by name, and reading the preemption marker.

The trainer writes them and the report (and Slurm's requeue logic) reads them; both import the names from
here, so the reader never has to import the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

LOG_NAME = "log.jsonl"  # DLLogger-format records, one JSON object per line
PLOT_NAME = "loss.png"
MARKER_NAME = "preempted.json"  # written when a run stopped for preemption, removed when a run starts
EVAL_DIR = "eval"  # ``megatron-recipes eval`` keeps each evaluation here: step_NNNNNNN.json


def read_evaluations(run_dir: Path | str) -> list:
    """The evaluations ``eval`` kept for a run, in step order; a file that does not parse is skipped."""
    out = []
    for path in sorted((Path(run_dir) / EVAL_DIR).glob("step_*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def read_marker(run_dir: Path | str) -> Optional[dict]:
    """The ``preempted.json`` of a run, or None when the last run was not preempted."""
    path = Path(run_dir) / MARKER_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
