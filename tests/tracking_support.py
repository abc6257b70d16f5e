"""Read what a tracker wrote with the tracker's own reader (TensorBoard, W&B offline files, MLflow)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple


def tensorboard_scalars(folder: Path, key: str) -> List[Tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def wandb_records(run_dir: Path) -> Tuple[Dict[int, Dict[str, str]], Dict[str, str], List[str]]:
    """(history by step, config, tags) from the single offline run under ``run_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    (path,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    ds = DataStore()
    ds.open_for_scan(str(path))
    history: Dict[int, Dict[str, str]] = {}
    config: Dict[str, str] = {}
    tags: List[str] = []
    while (data := ds.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
        elif kind == "config":
            config.update({i.key: i.value_json for i in rec.config.update})
        elif kind == "run":
            tags = list(rec.run.tags)
    return history, config, tags


def mlflow_run(uri: str, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


def mlflow_history(uri: str, experiment: str, key: str) -> List[Tuple[int, float]]:
    client, run = mlflow_run(uri, experiment)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
