"""A real (short) training run with all three trackers on, its report.html, and the report in a real
headless browser (Debian's ``chromium``); plus a run whose MLflow server cannot be reached."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

import tracking_support as ts_
import train_support as ts
from megatron_recipes.cli import main as cli_main
from megatron_recipes.report import build_report
from megatron_recipes.report.charts import line_chart, ticks
from megatron_recipes.training.sinks import step_records

pytestmark = pytest.mark.slow
SECTIONS = ("summary", "curves", "plan", "layout", "checkpoints", "restarts", "versions", "recipe")
TRAIN_BLUE = (0x1F, 0x6F, 0xB5)  # charts.COLORS[0], the train-loss line
RUN = [*ts.FAST[:6], "parallel.tp=1", "train.train_iters=12", "optimizer.lr_warmup_iters=2", "logging.log_interval=2",
       "logging.eval_interval=4", "logging.eval_iters=1", "checkpoint.save_interval=6", "logging.plot=true"]



@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    """One rank, 12 steps, TensorBoard + W&B (offline) + MLflow (local SQLite store) all on."""
    for module in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(module, reason=f"{module} is part of the test extra (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    run = ts.train(root / "run", cache, *RUN, "logging.tensorboard=true", "logging.wandb_project=recipes-test",
                   f"logging.mlflow_tracking_uri={uri}", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}).check()
    return run, uri


def _logged(run, key):
    return [(r["step"], r["data"][key]) for r in step_records(run.run_dir / "log.jsonl")
            if isinstance(r["data"].get(key), (int, float))]


def _same(got, expected, rel):
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=rel)


def test_trackers_hold_the_same_scalars_as_log_jsonl(trained):
    run, uri = trained
    assert "warning" not in run.output.lower(), run.output[-3000:]
    history, _, _ = ts_.wandb_records(run.run_dir)
    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "peak_mem_gib"):
        expected = _logged(run, key)
        assert expected, key
        _same(ts_.tensorboard_scalars(run.run_dir / "tensorboard", key), expected, 1e-6)  # stored as float32
        _same(ts_.mlflow_history(uri, "tiny_llama_cpu", key), expected, 1e-12)
        _same([(s, float(h[key])) for s, h in sorted(history.items()) if key in h], expected, 1e-12)
    client, mlrun = ts_.mlflow_run(uri, "tiny_llama_cpu")
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["train.train_iters"] == "12"
    assert {"loss.png", "report.html", "config.yaml"} <= {a.path for a in client.list_artifacts(mlrun.info.run_id)}


def test_the_run_writes_its_report(trained):
    run, _ = trained
    page = (run.run_dir / "report.html").read_text()
    assert f"report: {run.run_dir / 'report.html'}" in run.output
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page, sid
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)  # nothing to fetch: opens offline
    assert "<script" not in page and "data:image/png;base64," in page  # the rank picture is inline
    drawn = [int(n) for n in re.findall(r'<polyline class="series" data-n="(\d+)"', page)]
    assert drawn[:2] == [6, 3]  # train loss every 2 steps, validation loss every 4
    assert "iter_0000006" in page and "iter_0000012" in page
    assert "megatron-core" in page and "finished" in page


def test_report_rebuilds_while_a_run_is_writing(trained, tmp_path):
    """A live run's log may end in half a line; `report` reads what is complete."""
    run, _ = trained
    live = tmp_path / "live"
    shutil.copytree(run.run_dir, live, ignore=shutil.ignore_patterns("wandb", "tensorboard", "checkpoints"))
    text = (live / "log.jsonl").read_text()
    (live / "log.jsonl").write_text(text[: len(text) // 2])  # cut mid-record
    assert cli_main(["report", str(live), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "in progress or stopped" in page and "no checkpoint" in page


def test_report_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


_NO_PICTURE = """
import sys
from pathlib import Path
from megatron_recipes.config.compose import compose_recipe, to_yaml
from megatron_recipes.report import build_report
run = Path(sys.argv[1])
run.mkdir()
(run / "config.yaml").write_text(to_yaml(compose_recipe("tiny_llama_cpu", [f"run.dir={run}"])))
page = build_report(run, picture=False).read_text()
print("matplotlib imported:", "matplotlib" in sys.modules)
print("png:", "data:image/png;base64," in page, "note:", "no picture: logging.plot=false" in page)
page = build_report(run).read_text()
print("then png:", "data:image/png;base64," in page)
"""


def test_report_without_picture_imports_no_matplotlib(tmp_path):
    """The trainer's report of a ``logging.plot=false`` run skips the layout picture and matplotlib's
    start-up (about a second per run); ``report`` (the default) still draws it."""
    import sys

    proc = subprocess.run([sys.executable, "-c", _NO_PICTURE, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "matplotlib imported: False" in proc.stdout
    assert "png: False note: True" in proc.stdout and "then png: True" in proc.stdout


def test_charts_draw_points_and_say_when_empty():
    assert 'data-n="3"' in line_chart("loss", [("train", [(1, 3.0), (2, 2.0), (3, 1.0)])], "nats")
    empty = line_chart("loss", [("train", [])], "nats")
    assert "polyline" not in empty and "no data logged yet" in empty
    assert ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def _closed_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_mlflow_server_warns_once_and_training_completes(tmp_path, cache):
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{_closed_loopback_port()}"
    run = ts.train(tmp_path / "run", cache, *ts.FAST, "parallel.tp=1", "train.train_iters=4", "optimizer.lr_warmup_iters=1",
                   f"logging.mlflow_tracking_uri={uri}").check()
    assert run.output.count("is unreachable") == 1, run.output[-3000:]
    assert f"logging.mlflow_tracking_uri={uri} is unreachable: 127.0.0.1:" in run.output
    assert [r["step"] for r in run.records()] == [1, 2, 3, 4]  # every step trained and logged


# ----- the page in a real browser ------------------------------------------------------------------
def _browser():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render_in_browser(page: Path, out_dir: Path):
    """Headless chromium: the DOM after rendering, a screenshot, and the browser's console log."""
    exe = _browser()
    common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
              "--enable-logging=stderr", "--v=0", "--window-size=1280,1500", f"--user-data-dir={out_dir / 'profile'}"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    shot = out_dir / "report.png"
    snap = subprocess.run([*common, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    return dom, snap, shot


def test_report_renders_in_headless_chromium(trained, tmp_path):
    if _browser() is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium); the page is not browser-checked")
    run, _ = trained
    dom, snap, shot = render_in_browser(run.run_dir / "report.html", tmp_path)
    assert dom.returncode == 0 and snap.returncode == 0, dom.stderr[-2000:] + snap.stderr[-2000:]
    console = [line for line in (dom.stderr + snap.stderr).splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    for sid in SECTIONS:
        assert f'id="{sid}"' in dom.stdout, sid
    assert len(re.findall(r'<polyline class="series" data-n="[1-9]', dom.stdout)) >= 6
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(shot))[..., :3] * 255).round().astype(int)
    blue = ((abs(pixels - TRAIN_BLUE)).sum(axis=-1) <= 6).sum()  # no other part of the page uses this colour
    assert blue > 1000, f"the curves are not visible in the screenshot ({blue} pixels of the series colour)"


def _log_line(kind: str, **fields) -> str:
    return "DLLL " + json.dumps({"timestamp": "0", "datetime": "2026-12-03 00:00:00", "elapsedtime": "0", "type": kind, **fields})


def _fine_tuning_run(root: Path) -> Path:
    from megatron_recipes.config.compose import compose_recipe, to_yaml

    run = root / "lora"
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(compose_recipe("tiny_llama_lora", [f"run.dir={run}"])))
    lines = [_log_line("METADATA", metric="run", metadata={"layout": "TP=2", "start_step": 0,
                                                              "peft": {"method": "lora", "trainable": 655360, "total": 1967232}})]
    for step, acc in ((0, 0.0), (50, 0.4), (100, 0.853)):
        lines.append(_log_line("LOG", step=step, data={"loss": 1.0 / (step + 1), "val_loss": 2.0 / (step + 1), "task_accuracy": acc}))
    (run / "log.jsonl").write_text("\n".join(lines) + "\n")
    (run / "eval" / "step_0000100.json").write_text(json.dumps(
        {"step": 100, "layout": "tp=2 pp=1", "loss": {"val_loss": 0.0403, "perplexity": 1.041},
         "answers": {"exact_match": 0.898, "answers": 512, "right": 460}}))
    (run / "eval" / "step_0000050.json").write_text('{"step": 50, "loss": {"val_lo')  # torn: skipped
    return run


def test_report_of_a_fine_tuning_run_shows_adapters_accuracy_and_evaluations(tmp_path):
    run = _fine_tuning_run(tmp_path)
    page = build_report(run, picture=False).read_text()
    section = page[page.index('id="finetuning"'):page.index('id="plan"')]
    for text in ("lora", "output_layer", "655,360 of 1,967,232 (33.3138%)", "0.0% at step 0 -&gt; 85.3% at step 100",
                 "0.0403", "89.8% of 512"):
        assert text in section, (text, section)
    assert ">task accuracy<" in page  # the curve, among the report's charts
    from megatron_recipes.training.sinks import loss_figure

    fig = loss_figure(run / "log.jsonl")
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel() == "task accuracy (%)"
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(_log_line("LOG", step=s, data={"loss": 1.0}) for s in (1, 2)) + "\n")
    assert len(loss_figure(plain).axes) == 1  # a pretraining run: loss only
