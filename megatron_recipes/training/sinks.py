"""Where metrics go: ``log.jsonl`` (DLLogger records), the trackers (``tracking.py``), the console, a PNG.

``log.jsonl`` holds one JSON object per line in DLLogger's record layout (``timestamp``, ``datetime``,
``elapsedtime``, ``type``, ``step``, ``data``). When ``dllogger`` is importable its ``Logger`` drives
the writing through a backend of ours; DLLogger's own ``JSONStreamBackend`` prefixes every line with
``DLLL ``, which would make the file not JSON-lines, so the backend is ours either way. Only rank 0
writes; on resume the lines after the resumed step are dropped, so the file tells one history.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from megatron_recipes import files
from megatron_recipes.run_files import LOG_NAME, PLOT_NAME  # noqa: F401  (loop reads both here)

if TYPE_CHECKING:
    from megatron_recipes.config.schema import RunConfig



def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so every line still parses."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlBackend:
    """A DLLogger backend (also usable alone) writing one DLLogger record per line, flushed each time."""

    def __init__(self, path: Path, append: bool) -> None:
        self.verbosity = 0
        self.file = open(path, "a" if append else "w", encoding="utf-8")

    def _write(self, timestamp: datetime, elapsedtime: float, kind: str, **fields: Any) -> None:
        """One DLLogger record: the common header, then the record's own fields."""
        record = dict(
            timestamp=str(timestamp.timestamp()), datetime=str(timestamp), elapsedtime=str(elapsedtime), type=kind
        )
        self.file.write(json.dumps({**record, **fields}) + "\n")
        self.file.flush()

    def log(self, timestamp: datetime, elapsedtime: float, step: Any, data: Dict[str, Any]) -> None:
        self._write(timestamp, elapsedtime, "LOG", step=step, data={k: _clean(v) for k, v in data.items()})

    def metadata(self, timestamp: datetime, elapsedtime: float, metric: str, metadata: Dict[str, Any]) -> None:
        self._write(timestamp, elapsedtime, "METADATA", metric=metric, metadata=metadata)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _PlainLogger:
    """DLLogger's ``Logger`` interface for when dllogger is not installed."""

    def __init__(self, backends: List[JsonlBackend]) -> None:
        self.backends = backends
        self.start = datetime.now()

    def log(self, step: Any, data: Dict[str, Any], verbosity: int = 0) -> None:
        now = datetime.now()
        for b in self.backends:
            b.log(now, (now - self.start).total_seconds(), step, data)

    def metadata(self, metric: str, metadata: Dict[str, Any]) -> None:
        now = datetime.now()
        for b in self.backends:
            b.metadata(now, (now - self.start).total_seconds(), metric, metadata)


def _dllogger(backends: List[JsonlBackend]):
    try:
        import dllogger
    except ImportError:
        return _PlainLogger(backends)
    return dllogger.Logger(backends)


def read_log(path: Path) -> List[Dict[str, Any]]:
    """Every record of a ``log.jsonl`` (also accepts DLLogger's ``DLLL ``-prefixed lines)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("DLLL "):
            line = line[5:]
        if line:
            try:
                records.append(json.loads(line))
            except ValueError:  # a line torn by a kill mid-write: not a record
                continue
    return records


def step_records(path: Path) -> List[Dict[str, Any]]:
    """Training-step LOG records (integer ``step``), in file order."""
    return [r for r in read_log(path) if r.get("type") == "LOG" and isinstance(r.get("step"), int)]


def _line_step(line: str) -> Optional[int]:
    """The record's integer step (0 for records without one); None for a line that is not a record."""
    try:
        record = json.loads(line.removeprefix("DLLL "))
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else 0


def truncate_after(path: Path, step: int) -> None:
    """Drop step records after ``step`` (a resumed run repeats them) and lines torn by a kill; atomic rewrite."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    keep = [line for line in lines if (at := _line_step(line)) is not None and at <= step]
    files.write_text(path, "".join(line + "\n" for line in keep))


class MetricsLog:
    """Rank 0's sinks for one run directory: ``log.jsonl`` always, plus the trackers the recipe asks for
    (``training/tracking.py``: TensorBoard, W&B, MLflow) when a recipe is given."""

    def __init__(self, run_dir: Path, resume_step: int, cfg: Optional["RunConfig"] = None) -> None:
        self.path = run_dir / LOG_NAME
        if resume_step > 0:
            truncate_after(self.path, resume_step)
        self.backend = JsonlBackend(self.path, append=resume_step > 0)
        self.logger = _dllogger([self.backend])
        self.trackers = None
        if cfg is not None:
            from megatron_recipes.config.compose import to_yaml
            from megatron_recipes.training.tracking import open_trackers

            self.trackers = open_trackers(cfg, run_dir, resume_step, to_yaml(cfg))
            if self.trackers.notes:
                print("tracking: " + "; ".join(self.trackers.notes), flush=True)

    def metadata(self, metric: str, metadata: Dict[str, Any]) -> None:
        self.logger.metadata(metric, metadata)

    def log(self, step: Any, data: Dict[str, Any]) -> None:
        self.logger.log(step=step, data=data, verbosity=0)
        if self.trackers is not None and isinstance(step, int):
            self.trackers.log(step, data)

    def close(self, curve: Optional[Path] = None, report: Optional[Path] = None, finished: bool = False) -> None:
        """Close the log and end the trackers (with the loss curve and report when the run finished)."""
        if not self.backend.file.closed:
            self.backend.close()
        if self.trackers is not None:
            self.trackers.close(curve if curve and curve.is_file() else None, report if report and report.is_file() else None, finished)


def plot_losses(log_path: Path, out_path: Path, title: str = "", baseline: Optional[float] = None) -> Optional[Path]:
    """Training (and validation) loss against step, from ``log.jsonl``; written atomically.

    ``baseline``: a reference loss drawn as a dashed line (the corpus' unigram entropy: what a model
    that ignores context would reach)."""
    import matplotlib.pyplot as plt

    fig = loss_figure(log_path, title, baseline)
    if fig is None:
        return None
    try:
        with files.replacing(out_path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return out_path


def loss_figure(log_path: Path, title: str = "", baseline: Optional[float] = None):
    """The figure of ``plot_losses`` (None before the first logged loss); a fine-tuning run's task accuracy
    on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, valid, accuracy = [], [], []
    for rec in step_records(log_path):
        data = rec["data"]
        if isinstance(data.get("loss"), (int, float)):
            train.append((rec["step"], data["loss"]))
        if isinstance(data.get("val_loss"), (int, float)):
            valid.append((rec["step"], data["val_loss"]))
        if isinstance(data.get("task_accuracy"), (int, float)):
            accuracy.append((rec["step"], 100.0 * data["task_accuracy"]))
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(*zip(*train), label="train loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, linestyle="--", color="gray", label=f"unigram entropy ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if accuracy:  # a fine-tuning run: the share of validation answers right, on its own axis
        right = ax.twinx()
        right.plot(*zip(*accuracy), "s--", color="tab:green", label="task accuracy (%)")
        right.set_ylabel("task accuracy (%)")
        right.set_ylim(0, 100)
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels)
    fig.tight_layout()
    return fig
