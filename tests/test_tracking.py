"""Experiment trackers, read back with each library's own reader: TensorBoard's EventAccumulator, W&B's
offline run directory, MLflow's MlflowClient on a local store; and the guard that keeps a failing or
blocked tracker from stopping or slowing training."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

import tracking_support as ts_
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.training import sinks, tracking

STEPS = {1: {"loss": 8.0, "lr": 1e-3, "grad_norm": 2.5, "tokens_per_sec": 1000.0, "mfu": "n/a"},
         2: {"loss": 7.0, "lr": 2e-3, "grad_norm": 2.0, "tokens_per_sec": 1100.0, "mfu": "n/a", "val_loss": 7.5},
         3: {"loss": 6.5, "lr": 3e-3, "grad_norm": 1.5, "tokens_per_sec": 1200.0, "mfu": "n/a"}}


def _cfg(tmp_path: Path, *overrides: str):
    return compose_recipe("tiny_llama_cpu", [f"run.dir={tmp_path}", "logging.tensorboard=false", *overrides])


def _log_and_close(tmp_path: Path, cfg) -> Path:
    """Rank 0's sink as the trainer drives it: metadata, step records, then the end with the loss curve."""
    log = sinks.MetricsLog(tmp_path, 0, cfg)
    log.metadata("run", {"layout": "TP=1"})
    for step, data in STEPS.items():
        log.log(step, data)
    curve = sinks.plot_losses(tmp_path / sinks.LOG_NAME, tmp_path / sinks.PLOT_NAME)
    log.close(curve, finished=True)
    return curve


def test_tensorboard_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_and_close(tmp_path, _cfg(tmp_path, "logging.tensorboard=true"))
    assert ts_.tensorboard_scalars(tmp_path / "tensorboard", "loss") == [(1, 8.0), (2, 7.0), (3, 6.5)]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [(2, 7.5)]
    assert [e.step for e in acc.Scalars("grad_norm")] == [1, 2, 3]
    assert "mfu" not in acc.Tags()["scalars"]  # "n/a" is not a number
    assert len(acc.Images("loss_curve")) == 1  # the loss curve at the end
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "seq_length: 128" in config_text  # the resolved recipe


def test_wandb_offline_run_directory_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_and_close(tmp_path, _cfg(tmp_path, "logging.wandb_project=recipes-test", "logging.tags=[ci,tiny]"))
    history, config, tags = ts_.wandb_records(tmp_path)
    for step, data in STEPS.items():
        assert float(history[step]["loss"]) == data["loss"] and float(history[step]["lr"]) == data["lr"]
    assert float(history[2]["val_loss"]) == 7.5 and "mfu" not in history[1]
    assert any(k.startswith("loss_curve/") for h in history.values() for k in h)  # the curve, at the end
    assert json.loads(config["train"])["seq_length"] == 128 and tags == ["ci", "tiny"]
    assert "wandb_run_id" in (tmp_path / tracking.IDS_NAME).read_text()  # a resumed run continues this one


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_mlflow_local_store_read_back(tmp_path, store, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy", reason="MLflow's SQL store needs sqlalchemy and alembic (the tracking extra)")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store only on request
    uri = (tmp_path / "mlruns").as_uri() if store == "file" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    _log_and_close(tmp_path, _cfg(tmp_path, f"logging.mlflow_tracking_uri={uri}", "logging.tracking_run_name=trial-1"))
    client, run = ts_.mlflow_run(uri, "tiny_llama_cpu")  # the experiment name defaults to run.name
    assert run.info.run_name == "trial-1" and run.info.status == "FINISHED"
    assert ts_.mlflow_history(uri, "tiny_llama_cpu", "loss") == [(1, 8.0), (2, 7.0), (3, 6.5)]
    assert run.data.metrics["val_loss"] == 7.5 and "mfu" not in run.data.metrics
    assert run.data.params["train.seq_length"] == "128" and run.data.params["parallel.tp"] == "2"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss.png", "config.yaml"} <= names
    if store == "sqlite":  # beside the database, not in the folder the job started from
        assert (tmp_path / "mlartifacts").is_dir() and not (Path.cwd() / "mlruns").exists()


def _closed_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


def test_probe_names_an_unreachable_server_and_an_unwritable_folder(tmp_path):
    why = tracking.probe(f"http://127.0.0.1:{_closed_loopback_port()}")
    assert why and "does not answer" in why
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert tracking.probe(f"http://127.0.0.1:{server.getsockname()[1]}") is None
    assert tracking.probe((tmp_path / "mlruns").as_uri()) is None
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root may write anywhere
        assert "not writable" in tracking.probe(f"file://{locked}/mlruns")


def test_asked_for_tracker_that_is_not_installed_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "_installed", lambda module: False)
    with pytest.raises(RecipeError, match=r"logging.mlflow_tracking_uri=.*not installed"):
        tracking.check_installed(_cfg(tmp_path, "logging.mlflow_tracking_uri=file:/x"))
    tracking.check_installed(_cfg(tmp_path))  # nothing asked for: fine


class _Failing:
    label = "Failing"

    def __init__(self):
        self.calls = 0

    def start(self, *args):
        pass

    def log(self, step, values):
        self.calls += 1
        raise ConnectionError("server went away")

    def finish(self, *args):
        raise ConnectionError("server went away")


class _Blocking:
    label = "Blocking"

    def __init__(self):
        self.inside, self.gate, self.first_done = threading.Event(), threading.Event(), threading.Event()

    def start(self, *args):
        pass

    def log(self, step, values):
        if self.first_done.is_set():
            return
        self.inside.set()
        self.gate.wait(timeout=10)  # a synchronous sink would hold the caller here
        self.first_done.set()

    def finish(self, *args):
        pass


def _trackers(tmp_path, tracker):
    t = tracking.Trackers(tmp_path, {}, [])
    t.guarded = [tracking.Guarded(tracker, _cfg(tmp_path), "", t.ids, t.save_ids)]
    return t


def test_failing_tracker_warns_once_and_stops_being_called(tmp_path, capsys):
    failing = _Failing()
    t = _trackers(tmp_path, failing)
    for step in range(1, 20):
        t.log(step, {"loss": 1.0})
    t.close(finished=True)
    err = capsys.readouterr().err
    assert err.count("warning: Failing logging failed (ConnectionError: server went away)") == 1, err
    assert failing.calls == 1


def test_blocked_tracker_does_not_hold_up_the_caller(tmp_path):
    blocking = _Blocking()
    t = _trackers(tmp_path, blocking)
    for step in range(1, 50):
        t.log(step, {"loss": 1.0})  # returns while the tracker's thread is stuck in its first call
    assert blocking.inside.wait(timeout=30)
    assert not blocking.first_done.is_set()  # a synchronous sink could not have returned yet
    blocking.gate.set()
    t.close(finished=True)
    assert blocking.first_done.is_set()


def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy", reason="MLflow's SQL store needs sqlalchemy and alembic (the tracking extra)")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _cfg(tmp_path, f"logging.mlflow_tracking_uri={uri}")
    first = sinks.MetricsLog(tmp_path, 0, cfg)
    for step in (1, 2, 3):
        first.log(step, STEPS[step])
    first.close()  # preempted after step 3, checkpoint at step 2
    client, run = ts_.mlflow_run(uri, "tiny_llama_cpu")
    assert run.info.status == "KILLED"
    again = sinks.MetricsLog(tmp_path, 2, cfg)
    again.log(3, {"loss": 6.4})
    again.close(finished=True)
    client, run = ts_.mlflow_run(uri, "tiny_llama_cpu")  # still one run in the experiment
    assert run.info.status == "FINISHED"
    assert [s for s, _ in ts_.mlflow_history(uri, "tiny_llama_cpu", "loss")] == [1, 2, 3, 3]
