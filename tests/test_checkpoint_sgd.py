"""SGD runs resume their own checkpoints exactly (preemption requeue relies on it), and a checkpoint of
one optimizer loaded by a run of the other is refused with one message instead of megatron-core's
``'NoneType' object is not callable``."""

from __future__ import annotations

from pathlib import Path

import pytest

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow
SGD = ["optimizer=sgd", "optimizer.lr=1e-2", "optimizer.sgd_momentum=0.9", "optimizer.use_distributed_optimizer=false"]


def _one_rank(tmp: str):
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes import checkpoint as ck

    tmp, out = Path(tmp), {}
    cfg = cs.tiny_cfg(str(tmp / "sgd"), extra=SGD)
    t = cs.Trainer(cfg)
    t.train(1, 3)
    root = ck.checkpoints_root(cfg)
    ck.save(root, 3, t.model, t.optimizer, t.scheduler, {"step": 3}, cfg, keep_last=1)
    out["straight"] = t.train(4, 6)

    resumed = cs.Trainer(cfg, seed=99)
    try:
        out["state"] = ck.load(root, resumed.model, resumed.optimizer, resumed.scheduler, cfg=cfg)
        out["resumed"] = resumed.train(4, 6)
    except Exception as exc:  # noqa: BLE001 (reported by the test)
        out["resumed"] = f"{type(exc).__name__}: {exc}"

    adam_cfg = cs.tiny_cfg(str(tmp / "adam"))
    adam = cs.Trainer(adam_cfg)
    adam.train(1, 1)
    ck.save(ck.checkpoints_root(adam_cfg), 1, adam.model, adam.optimizer, adam.scheduler, {"step": 1},
                       adam_cfg, keep_last=1)
    plain_cfg = cs.tiny_cfg(str(tmp / "plain"), extra=["optimizer.use_distributed_optimizer=false"])
    plain = cs.Trainer(plain_cfg)
    plain.train(1, 1)
    ck.save(ck.checkpoints_root(plain_cfg), 1, plain.model, plain.optimizer, plain.scheduler, {"step": 1}, plain_cfg,
            keep_last=1)
    for name, (load_root, trainer) in {"adam_into_sgd": (ck.checkpoints_root(adam_cfg), cs.Trainer(cfg)),
                                       "sgd_into_adam": (root, cs.Trainer(adam_cfg)),
                                       # before: KeyError 'pre_wd_mult' from megatron-core, halfway through
                                       "distributed_into_plain": (ck.checkpoints_root(adam_cfg), cs.Trainer(plain_cfg)),
                                       "plain_into_distributed": (ck.checkpoints_root(plain_cfg), cs.Trainer(adam_cfg)),
                                       }.items():
        try:
            ck.load(load_root, trainer.model, trainer.optimizer, trainer.scheduler, cfg=trainer.cfg)
            out[name] = "loaded"
        except RecipeError as exc:
            out[name] = str(exc)
        except Exception as exc:  # noqa: BLE001
            out[name] = f"RAW {type(exc).__name__}: {exc}"
    return out


def test_sgd_resumes_and_optimizer_switch_is_refused(tmp_path):
    (out,) = run_ranks(_one_rank, 1, str(tmp_path))
    assert out["resumed"] == out["straight"], out["resumed"]  # bit-identical continuation, momentum included
    assert out["state"]["step"] == 3
    assert "holds adam optimizer state, but this run uses optimizer.name=sgd" in out["adam_into_sgd"]
    assert "holds sgd optimizer state, but this run uses optimizer.name=adam" in out["sgd_into_adam"]
    assert "checkpoint.pretrained=" in out["adam_into_sgd"]
    assert "holds distributed optimizer state, but this run uses optimizer.use_distributed_optimizer=false" in out[
        "distributed_into_plain"]
    assert "holds non-distributed optimizer state" in out["plain_into_distributed"]
    assert "fix: resume with optimizer.use_distributed_optimizer=true" in out["distributed_into_plain"]
