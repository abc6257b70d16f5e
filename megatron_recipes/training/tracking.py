"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) fed from rank 0's metric records.

Each tracker runs on its own background thread behind a bounded queue, so a tracker that blocks (a
server that does not answer) or fails never stops or slows training: its first failure is printed once
and the tracker is off for the rest of the run. An MLflow server that cannot be reached at start-up is
said at start-up, and that tracker is not started at all. The run ids are kept in ``tracking.json`` so a
resumed (requeued) run continues the same W&B / MLflow run instead of starting a new one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import queue
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

from megatron_recipes import files
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

IDS_NAME = "tracking.json"
INSTALL = "pip install 'megatron-recipes[tracking]'"
QUEUE_SIZE = 10_000  # records waiting for a slow tracker; beyond that they are dropped (and counted)
CLOSE_TIMEOUT_S = 60.0  # how long the end of a run waits for a tracker to write its last records
PROBE_TIMEOUT_S = 3.0


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def scalars(data: Dict[str, Any]) -> Dict[str, float]:
    """The numeric, finite entries of a ``log.jsonl`` record (what a tracker can plot)."""
    return {
        k: float(v)
        for k, v in data.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def flat_params(cfg: RunConfig) -> Dict[str, str]:
    """The resolved recipe as dotted ``key: value`` strings (MLflow parameters)."""
    out: Dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)

    walk("", dataclasses.asdict(cfg))
    return out


# ----- the trackers: start / log / finish, all called on the tracker's own thread ---------------------
class TensorBoardTracker:
    label = "TensorBoard"

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def start(self, cfg: RunConfig, config_yaml: str, ids: Dict[str, str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.writer.add_text("config", "```\n" + config_yaml + "\n```")

    def log(self, step: int, values: Dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, curve: Optional[Path], report: Optional[Path], finished: bool) -> None:
        if curve is not None:
            import matplotlib.image

            self.writer.add_image("loss_curve", matplotlib.image.imread(str(curve))[..., :3], dataformats="HWC")
        self.writer.close()


class WandbTracker:
    label = "W&B"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def start(self, cfg: RunConfig, config_yaml: str, ids: Dict[str, str]) -> None:
        import wandb

        lg = cfg.logging
        self.run = wandb.init(
            project=lg.wandb_project,
            entity=lg.wandb_entity,
            name=lg.tracking_run_name or cfg.run.name,
            tags=list(lg.tags) or None,
            config=dataclasses.asdict(cfg),
            dir=str(self.run_dir),
            id=ids.get("wandb_run_id"),
            resume="allow",
        )
        ids["wandb_run_id"] = self.run.id

    def log(self, step: int, values: Dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, curve: Optional[Path], report: Optional[Path], finished: bool) -> None:
        import wandb

        if curve is not None:
            self.run.log({"loss_curve": wandb.Image(str(curve))})
        if report is not None:
            self.run.save(str(report), base_path=str(report.parent), policy="now")
        self.run.finish(exit_code=0 if finished else 1)


def _artifacts(uri: str) -> Optional[str]:
    """Artifacts of a local SQLite store go next to its database file; MLflow's default would be
    ``./mlruns`` under whatever folder the job happened to start in."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).expanduser().resolve().parent / "mlartifacts").as_uri()


class MlflowTracker:
    label = "MLflow"

    def __init__(self, uri: str) -> None:
        self.uri = uri

    def start(self, cfg: RunConfig, config_yaml: str, ids: Dict[str, str]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        lg = cfg.logging
        self.client = MlflowClient(tracking_uri=self.uri)
        run_id = ids.get("mlflow_run_id")
        if run_id is None:
            name = lg.mlflow_experiment or cfg.run.name
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name, _artifacts(self.uri))
            tags = {t: "true" for t in lg.tags}
            run_id = self.client.create_run(exp_id, run_name=lg.tracking_run_name or cfg.run.name, tags=tags).info.run_id
            params = [Param(k, v[:6000]) for k, v in flat_params(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            self.client.log_text(run_id, config_yaml, "config.yaml")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        ids["mlflow_run_id"] = run_id

    def log(self, step: int, values: Dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, curve: Optional[Path], report: Optional[Path], finished: bool) -> None:
        for path in (curve, report):
            if path is not None:
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


# ----- the guard: one thread per tracker -----------------------------------------------------------
class Guarded:
    """Runs one tracker's calls in order on a daemon thread; the first exception switches it off."""

    def __init__(self, tracker, cfg: RunConfig, config_yaml: str, ids: Dict[str, str], on_started) -> None:
        self.tracker = tracker
        self.on_started = on_started
        self.label = tracker.label
        self.failed = False
        self.dropped = 0
        self.queue: "queue.Queue" = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread = threading.Thread(target=self._work, name=f"tracker-{self.label}", daemon=True)
        self.thread.start()
        self._submit("start", cfg, config_yaml, ids)

    def _submit(self, method: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            self.queue.put_nowait((method, args))
        except queue.Full:
            self.dropped += 1

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            method, args = item
            if self.failed:
                continue
            try:
                getattr(self.tracker, method)(*args)
                if method == "start":
                    self.on_started()
            except Exception as exc:  # any failure of an optional tracker: say it once, keep training
                self.failed = True
                warn(f"{self.label} logging failed ({type(exc).__name__}: {str(exc)[:800]}); "
                     f"{self.label} is off for the rest of this run, training goes on")

    def log(self, step: int, values: Dict[str, float]) -> None:
        self._submit("log", step, values)

    def close(self, curve: Optional[Path], report: Optional[Path], finished: bool) -> None:
        self._submit("finish", curve, report, finished)
        try:
            self.queue.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self.thread.join(CLOSE_TIMEOUT_S)
        if self.thread.is_alive() and not self.failed:
            warn(f"{self.label} did not finish writing within {CLOSE_TIMEOUT_S:.0f} s; its last records may be missing")
        if self.dropped and not self.failed:
            warn(f"{self.label} fell behind: {self.dropped} record(s) were dropped")


# ----- choosing and starting the trackers ----------------------------------------------------------
def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(cfg: RunConfig) -> None:
    """An explicitly requested W&B or MLflow without its library is an error before any rank starts."""
    lg = cfg.logging
    for field_, value, module in (("wandb_project", lg.wandb_project, "wandb"), ("mlflow_tracking_uri", lg.mlflow_tracking_uri, "mlflow")):
        if value and not _installed(module):
            raise RecipeError(
                f"logging.{field_}={value} asks for {module}, which is not installed",
                fix=f"{INSTALL}, or drop logging.{field_}",
            )


def probe(uri: str) -> Optional[str]:
    """Why a tracking URI cannot be used right now, or None. Servers: one TCP connect, a few seconds at most."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            with socket.create_connection((parsed.hostname or "localhost", port), timeout=PROBE_TIMEOUT_S):
                return None
        except OSError as exc:
            return f"{parsed.hostname}:{port} does not answer ({exc.strerror or type(exc).__name__})"
    if parsed.scheme == "sqlite":
        folder = Path(uri[len("sqlite:///"):]).parent
    elif parsed.scheme in ("file", ""):
        folder = Path(parsed.path)
    else:
        return None  # other stores (databricks, ...): their client says what is wrong
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None


def _load_ids(run_dir: Path, resume_step: int) -> Dict[str, str]:
    path = run_dir / IDS_NAME
    if resume_step <= 0 or not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def open_trackers(cfg: RunConfig, run_dir: Path, resume_step: int, config_yaml: str) -> "Trackers":
    """The trackers the recipe asks for and this machine can run, each started on its own thread."""
    lg = cfg.logging
    chosen: List[Any] = []
    notes: List[str] = []
    if lg.tensorboard:
        if _installed("tensorboard"):
            chosen.append(TensorBoardTracker(run_dir / "tensorboard"))
            notes.append(f"TensorBoard -> {run_dir / 'tensorboard'}")
        else:
            notes.append(f"TensorBoard off: the tensorboard package is not installed ({INSTALL})")
    if lg.wandb_project:
        chosen.append(WandbTracker(run_dir))
        mode = os.environ.get("WANDB_MODE", "online")
        notes.append(f"W&B project {lg.wandb_project} ({mode})")
    if lg.mlflow_tracking_uri:
        why = probe(lg.mlflow_tracking_uri)
        if why:
            warn(f"logging.mlflow_tracking_uri={lg.mlflow_tracking_uri} is unreachable: {why}; MLflow logging is "
                 "off for this run, training goes on (start the server or fix the URI, then resume to log again)")
        else:
            chosen.append(MlflowTracker(lg.mlflow_tracking_uri))
            notes.append(f"MLflow {lg.mlflow_tracking_uri} (experiment {lg.mlflow_experiment or cfg.run.name})")
    trackers = Trackers(run_dir, _load_ids(run_dir, resume_step), notes)
    trackers.guarded = [Guarded(t, cfg, config_yaml, trackers.ids, trackers.save_ids) for t in chosen]
    return trackers


class Trackers:
    """All started trackers of a run, fed together."""

    def __init__(self, run_dir: Path, ids: Dict[str, str], notes: List[str]) -> None:
        self.run_dir = run_dir
        self.guarded: List[Guarded] = []
        self.ids = ids
        self.notes = notes
        self.closed = False
        self._lock = threading.Lock()

    def save_ids(self) -> None:
        """The trackers' run ids (called from their threads once started), for a resumed run."""
        with self._lock:
            if not self.ids:  # TensorBoard has no run id
                return
            files.write_text(self.run_dir / IDS_NAME, json.dumps(self.ids, indent=2) + "\n")

    def log(self, step: int, data: Dict[str, Any]) -> None:
        values = scalars(data)
        if values:
            for g in self.guarded:
                g.log(step, values)

    def close(self, curve: Optional[Path] = None, report: Optional[Path] = None, finished: bool = False) -> None:
        """Flush and end every tracker (waits a bounded time); ``finished``: the run reached train_iters."""
        if self.closed:
            return
        self.closed = True
        for g in self.guarded:
            g.close(curve, report, finished)
