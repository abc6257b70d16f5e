"""The run report: one self-contained HTML page (inline CSS, SVG and PNG; no network) from a run directory.

``megatron-recipes report <run.dir>`` rebuilds it at any time, also while the run is still going; the
trainer writes it at the end of every run. Only the cheap ``run_facts`` is imported by the trainer at
start-up; the page itself is built lazily.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from megatron_recipes.report.facts import run_facts

REPORT_NAME = "report.html"

__all__ = ["REPORT_NAME", "build_report", "run_facts", "write_report_after_run"]


def build_report(run_dir: Path, out: Optional[Path] = None, picture: bool = True) -> Path:
    """Write the report of ``run_dir`` (default ``run_dir/report.html``) atomically; returns its path.
    ``picture=False`` leaves out the layout picture (and matplotlib's import)."""
    from megatron_recipes.report.collect import collect
    from megatron_recipes import files
    from megatron_recipes.report.page import render

    run = collect(Path(run_dir), picture=picture)
    path = Path(out) if out is not None else run.run_dir / REPORT_NAME
    files.write_text(path, render(run))  # a browser or a sync job never sees half a page
    return path


def write_report_after_run(run_dir: Path, picture: bool = True) -> Optional[Path]:
    """The trainer's call: a report that cannot be built is a warning; the finished training stands.
    The trainer passes ``logging.plot`` as ``picture``: a run that asked for no plots draws none."""
    try:
        return build_report(run_dir, picture=picture)
    except Exception as exc:  # the run's results are already on disk; rebuild later with `report`
        print(f"warning: the run report could not be written ({type(exc).__name__}: {exc}); "
              f"rebuild it with `megatron-recipes report {run_dir}`", file=sys.stderr, flush=True)
        return None
