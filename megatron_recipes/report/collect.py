"""Everything the report shows, read from a run directory (which may still be written to by a live run)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron_recipes import checkpoint
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.run_files import LOG_NAME, read_evaluations, read_marker


@dataclass
class Checkpoint:
    step: int
    path: Path
    complete: bool
    size_bytes: int


@dataclass
class RunData:
    run_dir: Path
    config_text: str
    cfg: Optional[RunConfig]
    config_error: Optional[str]
    records: List[Dict[str, Any]]  # step records of log.jsonl
    starts: List[Dict[str, Any]]  # one "run" METADATA record per start (restarts after the first)
    preempted: Optional[dict]
    checkpoints: List[Checkpoint] = field(default_factory=list)
    plan: Optional[Dict[str, Any]] = None
    plan_error: Optional[str] = None
    picture_png: Optional[bytes] = None
    picture_note: Optional[str] = None  # why no picture was drawn though the plan was built
    evaluations: List[Dict[str, Any]] = field(default_factory=list)  # what ``eval`` kept (run_dir/eval)

    def series(self, key: str) -> List[tuple]:
        return [(r["step"], float(r["data"][key])) for r in self.records
                if isinstance(r["data"].get(key), (int, float)) and not isinstance(r["data"].get(key), bool)]

    @property
    def last_step(self) -> int:
        return max((r["step"] for r in self.records), default=0)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _checkpoints(root: Path) -> List[Checkpoint]:
    out = []
    if not root.is_dir():
        return out
    for path in sorted(root.iterdir()):
        step = checkpoint.step_of(path)
        if step is None or not path.is_dir():
            continue
        out.append(Checkpoint(step, path, checkpoint.is_complete(path), _size(path)))
    return sorted(out, key=lambda c: c.step)


def _plan(run: RunData, picture: bool) -> None:
    """The planner's view of the recipe the run used: layout, groups, memory estimate, and its picture
    (drawn with matplotlib, a second of start-up: only when ``picture``)."""
    import tempfile

    from megatron_recipes.plan.summary import build_plan

    try:
        run.plan = build_plan(run.cfg, run.cfg.run.name)
        if not picture:
            run.picture_note = f"logging.plot=false; `megatron-recipes report {run.run_dir}` draws it"
            return
        from megatron_recipes.plan.picture import draw_layout

        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / "layout.png"
            draw_layout(run.cfg, str(png), title=run.cfg.run.name)
            run.picture_png = png.read_bytes()
    except Exception as exc:  # a plan that cannot be built is shown as such; the rest of the report stands
        run.plan_error = f"{type(exc).__name__}: {exc}"


def collect(run_dir: Path, picture: bool = True) -> RunData:
    from megatron_recipes.config.compose import from_yaml

    run_dir = Path(run_dir).expanduser().resolve()
    config_path, log_path = run_dir / "config.yaml", run_dir / LOG_NAME
    if not config_path.is_file() and not log_path.is_file():
        raise RecipeError(
            f"'{run_dir}' is not a run directory: it has neither config.yaml nor {LOG_NAME}",
            fix="pass the run.dir of a training run (e.g. runs/tiny_llama_cpu)",
        )
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else ""
    cfg, config_error = None, None
    if config_text:
        try:
            cfg = from_yaml(config_path)
        except RecipeError as exc:
            config_error = exc.message
    records, starts = [], []
    if log_path.is_file():
        for rec in _read_records(log_path):
            if rec.get("type") == "LOG" and isinstance(rec.get("step"), int) and isinstance(rec.get("data"), dict):
                records.append(rec)
            elif rec.get("type") == "METADATA" and rec.get("metric") == "run":
                starts.append({"datetime": rec.get("datetime"), **rec.get("metadata", {})})
    run = RunData(run_dir, config_text, cfg, config_error, records, starts, read_marker(run_dir))
    run.checkpoints = _checkpoints(run_dir / "checkpoints")
    run.evaluations = read_evaluations(run_dir)
    if cfg is not None:
        _plan(run, picture)
    return run


def _read_records(path: Path) -> List[Dict[str, Any]]:
    """Records of ``log.jsonl``; a last line being written by a live run is skipped, not an error."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip().removeprefix("DLLL ")
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
