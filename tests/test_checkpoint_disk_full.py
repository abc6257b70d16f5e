"""A full disk during a save: one message naming the folder and the last complete checkpoint, the partial
folder removed; unfinished saves left by an earlier run are removed when the next run of it starts.

The full disk is simulated by fault injection: the file write megatron-core does for ``common.pt``
writes a few bytes and then fails with ENOSPC, as a full filesystem would."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow


def _save_on_full_disk(tmp: str):
    import torch

    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes import checkpoint as ck

    out = {}
    t = cs.Trainer(cs.tiny_cfg(str(Path(tmp) / "run")))
    root = ck.checkpoints_root(t.cfg)
    ck.save(root, 1, t.model, t.optimizer, t.scheduler, {"step": 1}, t.cfg, keep_last=2)
    real_save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):
        if str(f).endswith("common.pt"):
            Path(f).write_bytes(b"PK\x03\x04partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    torch.save = full_disk_save
    try:
        ck.save(root, 2, t.model, t.optimizer, t.scheduler, {"step": 2}, t.cfg, keep_last=2)
        out["error"] = "saved"
    except RecipeError as exc:
        out["error"] = str(exc)
    except BaseException as exc:  # noqa: BLE001 (a raw traceback is the failure under test)
        out["error"] = f"RAW {type(exc).__name__}: {exc}"
    finally:
        torch.save = real_save
    out["root"] = str(root)
    out["left"] = sorted(p.name for p in root.iterdir())
    out["latest"] = ck.latest(root).name
    return out


def test_disk_full_during_save(tmp_path):
    (out,) = run_ranks(_save_on_full_disk, 1, str(tmp_path))
    staging = Path(out["root"]) / "iter_0000002.incomplete"
    assert out["error"].startswith(f"disk full at {staging}, the last complete checkpoint is iter_0000001"), out["error"]
    assert out["left"] == ["iter_0000001", "latest_checkpointed_iteration.txt"], out["left"]
    assert out["latest"] == "iter_0000001"


def _start_again(run_dir: str):
    from megatron_recipes.config.compose import compose_recipe
    from megatron_recipes.training import loop

    cfg = compose_recipe("tiny_llama_cpu", [f"run.dir={run_dir}", "parallel=none", "cluster.gpus_per_node=1",
                                            "data=mock", "train.train_iters=1", "optimizer.lr_warmup_iters=0",
                                            "logging.plot=false", "logging.tensorboard=false",
                                            "checkpoint.save=false"])  # no save, so no prune: only start-up cleans
    return loop.run(cfg, "tiny_llama_cpu")


def test_next_start_removes_unfinished_saves(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for name in ("iter_0000040.incomplete", "iter_0000020.deleting"):
        (root / name).mkdir(parents=True)
        (root / name / "__0_0.distcp").write_bytes(b"x" * 100)
    assert run_ranks(_start_again, 1, str(tmp_path / "run")) == [0]
    assert list(root.iterdir()) == []
    assert not (tmp_path / "run" / "run.lock").exists()  # released when the run ended
