"""Read what a tracker wrote with the tracker's own reader (TensorBoard, W&B offline files, MLflow)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Tuple


def tensorboard_scalars(folder: Path, key: str) -> List[Tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def wandb_log_records(path: Path) -> List[bytes]:
    """The records of a ``.wandb`` transaction log: a 7-byte header (``:W&B``, magic, version), then
    LevelDB's log format (32 KiB blocks of chunks: crc32, little-endian length, type FULL/FIRST/MIDDLE/LAST)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, parts, pos = [], b"", 7
    while pos + 7 <= len(data):
        left_in_block = 32768 - pos % 32768
        if left_in_block < 7:  # block trailer: padding
            pos += left_in_block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            parts = (b"" if kind == 2 else parts) + chunk
        elif kind == 4:
            records.append(parts + chunk)
    return records


def wandb_records(run_dir: Path) -> Tuple[Dict[int, Dict[str, str]], Dict[str, str], List[str]]:
    """(history by step, config, tags) from the single offline run under ``run_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    # W&B's writer is its own process (wandb-core) and may still be flushing when run.finish() has
    # returned: wait (bounded) for the run's closing "exit" record.
    deadline = time.monotonic() + 60
    while True:
        records = []
        for data in wandb_log_records(path):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    history: Dict[int, Dict[str, str]] = {}
    config: Dict[str, str] = {}
    tags: List[str] = []
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
        elif kind == "config":
            config.update({i.key: i.value_json for i in rec.config.update})
        elif kind == "run":
            tags = list(rec.run.tags) or tags
            config.update({i.key: i.value_json for i in rec.run.config.update})
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
