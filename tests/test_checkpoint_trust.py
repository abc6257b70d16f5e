"""Loading a checkpoint runs no code from it: a crafted ``.metadata`` or ``common.pt`` whose unpickling
would create a sentinel file is refused with a message naming the file, and the file is not created.
Our own checkpoints (optimizer, scheduler, RNG streams) still load; ``checkpoint.trust_code=true`` and
``convert --trust-checkpoint`` are the explicit opt-out."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow


class _Payload:
    """Unpickling this opens (creates) the sentinel file: code chosen by whoever wrote the checkpoint."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (self.sentinel, "w"))


def _plant(ckpt: Path, name: str, sentinel: Path) -> None:
    if name == ".metadata":
        (ckpt / name).write_bytes(pickle.dumps(_Payload(str(sentinel))))
    else:
        torch.save({"state": _Payload(str(sentinel))}, ckpt / name)


def _attempt(fn):
    from megatron_recipes.config.errors import RecipeError

    try:
        fn()
    except RecipeError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 (a raw exception is a failure of its own)
        return f"RAW {type(exc).__name__}: {exc}"
    return "loaded"


def _record_as_saved(folder: Path) -> None:
    """meta.json's checksum record rewritten for ``folder``'s current files, as a crafter would."""
    import json

    from megatron_recipes.checkpoint import _checksums

    meta = json.loads((folder / "meta.json").read_text())
    meta[_checksums.KEY] = _checksums.record(folder)
    (folder / "meta.json").write_text(json.dumps(meta))


def _one_rank(tmp: str):
    from megatron_recipes import checkpoint as ck

    tmp, out = Path(tmp), {}
    t = cs.Trainer(cs.tiny_cfg(str(tmp / "run")))
    t.train(1, 1)  # optimizer state exists
    root = ck.checkpoints_root(t.cfg)
    ck.save(root, 1, t.model, t.optimizer, t.scheduler, {"step": 1, "note": "x"}, t.cfg, keep_last=1)
    latest = ck.latest(root)

    # Our own full checkpoint loads under the restrictions (index classes, RNG objects, common.pt).
    fresh = cs.Trainer(t.cfg, seed=7)
    out["own"] = _attempt(lambda: ck.load(latest, fresh.model, fresh.optimizer, fresh.scheduler, cfg=fresh.cfg))

    # Users set this to read old checkpoints; it turns megatron-core's plain torch.load(common.pt) unsafe.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    for name in (".metadata", "common.pt"):
        bad = tmp / f"bad{name}" / latest.name
        shutil.copytree(latest, bad)
        sentinel = tmp / f"SENTINEL{name}"
        _plant(bad, name, sentinel)
        _record_as_saved(bad)  # a crafted checkpoint carries a matching checksum record: trust is what stops it
        out[name] = _attempt(lambda: ck.load_weights(bad, fresh.model, fresh.cfg))
        out[f"{name} ran"] = sentinel.exists()
        trusting = cs.tiny_cfg(str(tmp / "run"), extra=["checkpoint.trust_code=true"])
        _attempt(lambda: ck.load_weights(bad, fresh.model, trusting))
        out[f"{name} ran when trusted"] = sentinel.exists()
    return out


def test_crafted_checkpoint_files_run_nothing(tmp_path):
    (out,) = run_ranks(_one_rank, 1, str(tmp_path))
    assert out["own"] == "loaded", out["own"]
    for name in (".metadata", "common.pt"):
        assert not out[f"{name} ran"], f"loading a crafted {name} ran its code"
        assert out[name].startswith("refusing to load") and name in out[name].splitlines()[0], out[name]
        assert "checkpoint.trust_code=true" in out[name]
        assert out[f"{name} ran when trusted"], f"checkpoint.trust_code=true did not lift the restriction ({name})"


def test_converter_reader_refuses_a_crafted_index(tmp_path, monkeypatch):
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.convert.dcp_io import CheckpointReader
    from megatron_recipes.checkpoint import TRUST_ENV

    monkeypatch.delenv(TRUST_ENV, raising=False)
    sentinel = tmp_path / "SENTINEL"
    (tmp_path / "ckpt").mkdir()
    _plant(tmp_path / "ckpt", ".metadata", sentinel)
    with pytest.raises(RecipeError, match=r"refusing to load .*\.metadata.*(io|builtins)\.open"):
        CheckpointReader(tmp_path / "ckpt").tensors()
    assert not sentinel.exists()
    monkeypatch.setenv(TRUST_ENV, "1")  # what `convert --trust-checkpoint` sets: the payload now runs
    with pytest.raises(Exception):  # noqa: B017 (the planted object is not an index; any failure after it ran)
        CheckpointReader(tmp_path / "ckpt").tensors()
    assert sentinel.exists()


def test_a_checkpoints_own_config_cannot_grant_trust(tmp_path):
    from megatron_recipes.config.compose import from_yaml, to_yaml

    cfg = cs.tiny_cfg(str(tmp_path), extra=["checkpoint.trust_code=true"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert from_yaml(tmp_path / "config.yaml").checkpoint.trust_code is False
