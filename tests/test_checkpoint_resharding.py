"""Save / resume / reshard with the real trainer set-up on gloo ranks (CPU lane).

Two process groups of 2 ranks. The first (A) trains and saves; the second starts fresh and runs phases
B-F one after another, re-initialising megatron-core's parallel state for each layout:
  A  TP=2        trains steps 1-2, saves; records logits, RNG draws, optimizer state, steps 3-4 losses
  B  TP=2        fresh processes resume it: RNG, params, optimizer state, steps 3-4 bit-identical
  C  TP=1 DP=2   resumes it resharded (TP 2->1, distributed-optimizer DP 1->2), saves it at DP=2
  D  PP=2 VPP=2  loads its weights, then all of it (chunks model0/model1); saves it in this layout
  E  TP=2        resumes D's PP=2/VPP=2 checkpoint: logits and steps 3-4 losses match A's
  F  PP=2        resumes C's DP=2 checkpoint with the 1F1B schedule: steps 3-4 losses match A's
Tolerances: same layout bit-exact; another layout 1e-5 (float32 summation order differs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow
STATE = {"step": 2, "consumed_samples": 2 * cs.GBS, "data": {"epoch": 0, "offsets": [3, 5]}}


def _save(trainer, root, step, state, keep_last=2):
    from megatron_recipes.checkpoint import save

    return save(
        Path(root), step, trainer.model, trainer.optimizer, trainer.scheduler, state, trainer.cfg, keep_last=keep_last
    )


def _rank_a(run_dir: str):
    t = cs.Trainer(cs.tiny_cfg(run_dir, tp=2, world=2))
    losses_12 = t.train(1, 2)
    path = _save(t, Path(run_dir) / "checkpoints", 2, STATE)
    draws = cs.rng_draws()  # first thing after the save, as the resumed run's first thing after the load
    out = {
        "draws": draws,
        "path": str(path),
        "params": t.param_tensors(),
        "optim": t.optimizer_tensors(),
        "lr": t.optimizer.param_groups[0]["lr"],
        "logits": t.logits(),
    }
    out["losses_34"] = t.train(3, 4)
    out["losses_12"] = losses_12
    return out


def _rank_b(run_dir: str):
    from megatron_recipes.checkpoint import load
    from megatron_recipes.checkpoint._start import resolve_load

    t = cs.Trainer(cs.tiny_cfg(run_dir, tp=2, world=2), seed=77)  # other init: the load must overwrite it
    path = resolve_load(t.cfg)  # checkpoint.load=auto
    state = load(path, t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    out = {
        "path": str(path),
        "state": state,
        "params": t.param_tensors(),
        "optim": t.optimizer_tensors(),
        "lr": t.optimizer.param_groups[0]["lr"],
    }
    out["draws"] = cs.rng_draws()
    out["losses_34"] = t.train(3, 4)
    return out


def _rank_c(run_dir: str, ckpt: str):
    from megatron_recipes.checkpoint import load

    t = cs.Trainer(cs.tiny_cfg(run_dir, tp=1, world=2), seed=77)
    state = load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    path = _save(t, Path(run_dir) / "checkpoints", 2, state)  # DP=2: optimizer shards gathered, writes spread
    return {"state": state, "path": str(path), "logits": t.logits(), "losses_34": t.train(3, 4)}


def _rank_d(run_dir: str, ckpt: str):
    from megatron_recipes.checkpoint import load, load_weights

    t = cs.Trainer(cs.tiny_cfg(run_dir, pp=2, vpp=2, world=2), seed=77)
    load_weights(Path(ckpt), t.model, t.cfg)
    weights_logits = t.logits()
    state = load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    path = _save(t, Path(run_dir) / "checkpoints", 2, state)
    return {"weights_logits": weights_logits, "logits": t.logits(), "path": str(path)}


def _rank_e(run_dir: str, ckpt: str):
    from megatron_recipes.checkpoint import load

    t = cs.Trainer(cs.tiny_cfg(run_dir, tp=2, world=2), seed=77)
    state = load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    return {"state": state, "logits": t.logits(), "losses_34": t.train(3, 4)}


def _rank_f(run_dir: str, ckpt: str):
    from megatron_recipes.checkpoint import load

    t = cs.Trainer(cs.tiny_cfg(run_dir, pp=2, world=2), seed=77)
    state = load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    return {"state": state, "losses_34": t.train(3, 4)}


def _rank_fresh(tmp: str, ckpt: str):
    """B-F in the same fresh processes (each phase builds its own layout from scratch)."""
    root = Path(tmp)
    out = {"b": _rank_b(str(root / "tp2"))}
    out["c"] = _rank_c(str(root / "tp1dp2"), ckpt)
    out["d"] = _rank_d(str(root / "pp2vpp2"), ckpt)
    out["e"] = _rank_e(str(root / "tp2again"), out["d"]["path"])
    out["f"] = _rank_f(str(root / "pp2"), out["c"]["path"])
    return out


def _first(results, key):
    return next(r[key] for r in results if r[key] is not None)


def _assert_close(a, b, what, rtol=1e-5, atol=1e-5):
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max abs diff {(a - b).abs().max().item():.3g}"


def test_resume_and_reshard(tmp_path):
    run_a = tmp_path / "tp2"
    a = run_ranks(_rank_a, 2, str(run_a))
    ckpt = Path(a[0]["path"])
    assert ckpt.name == "iter_0000002" and (ckpt / "meta.json").is_file() and (ckpt / "config.yaml").is_file()
    assert (run_a / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ref_logits = _first(a, "logits")
    assert ref_logits.shape == (1, cs.SEQ, cs.VOCAB)

    fresh = run_ranks(_rank_fresh, 2, str(tmp_path), str(ckpt))

    # B: same layout, fresh processes -> everything bit-identical, per rank.
    b = [r["b"] for r in fresh]
    for rank in range(2):
        ra, rb = a[rank], b[rank]
        assert rb["path"] == str(ckpt)
        assert rb["state"] == STATE
        assert rb["lr"] == ra["lr"]
        assert ra["params"].keys() == rb["params"].keys()
        for name in ra["params"]:
            assert torch.equal(ra["params"][name], rb["params"][name]), f"rank {rank} param {name}"
        assert len(ra["optim"]) == len(rb["optim"]) > 0
        assert all(torch.equal(x, y) for x, y in zip(ra["optim"], rb["optim"])), f"rank {rank} optimizer state"
        for key in ("torch", "tracker"):
            assert torch.equal(ra["draws"][key], rb["draws"][key]), f"rank {rank} {key} RNG"
        assert (ra["draws"]["python"], ra["draws"]["numpy"]) == (rb["draws"]["python"], rb["draws"]["numpy"])
        assert rb["losses_34"] == ra["losses_34"]  # step 4 depends on Adam's moments, step count and LR
    # The two TP ranks' tracker streams differ, so restoring rank 0's on both would have been caught above.
    assert not torch.equal(a[0]["draws"]["tracker"], a[1]["draws"]["tracker"])

    # C: TP=2 -> TP=1 with DP=2 (distributed-optimizer shards move too).
    c = [r["c"] for r in fresh]
    assert c[0]["state"] == STATE
    for rank in range(2):
        _assert_close(c[rank]["logits"], ref_logits, f"TP=1 rank {rank} logits")
        assert c[rank]["losses_34"] == pytest.approx(a[0]["losses_34"], rel=1e-5)

    # D: PP=2 x VPP=2 (chunks model0/model1) loads the TP=2 checkpoint, then saves it in its own layout.
    d = [r["d"] for r in fresh]
    _assert_close(_first(d, "weights_logits"), ref_logits, "PP=2/VPP=2 logits after load_weights")
    _assert_close(_first(d, "logits"), ref_logits, "PP=2/VPP=2 logits after checkpoint.load")
    meta = json.loads((Path(d[0]["path"]) / "meta.json").read_text())
    assert meta["contents"]["model_chunks"] == 2 and meta["layout"]["vpp"] == 2

    # E: that PP=2/VPP=2 checkpoint resumed at TP=2: weights and optimizer survived two reshardings.
    e = [r["e"] for r in fresh]
    assert e[0]["state"] == STATE
    _assert_close(_first(e, "logits"), ref_logits, "TP=2 logits from the PP=2/VPP=2 checkpoint")
    assert e[0]["losses_34"] == pytest.approx(a[0]["losses_34"], rel=1e-5)

    # F: C's TP=1/DP=2 checkpoint resumed at PP=2 (1F1B) trains on like the original.
    f = [r["f"] for r in fresh]
    assert f[0]["state"] == STATE
    assert f[0]["losses_34"] == pytest.approx(a[0]["losses_34"], rel=1e-5)


MOE = ["model=tiny_moe", "model.moe_ffn_hidden_size=64", "model.rotary_base=10000.0"]


def _rank_moe(run_dir: str):
    """EP=2 trains and saves; then the same ranks rebuild at EP=1 (experts replicated) and resume it."""
    from megatron_recipes.checkpoint import load

    t = cs.Trainer(cs.tiny_cfg(run_dir, world=2, extra=MOE + ["parallel.ep=2"]))
    t.train(1, 2)
    path = _save(t, Path(run_dir) / "checkpoints", 2, STATE)
    ep2 = {"logits": t.logits(), "losses_34": t.train(3, 4)}
    u = cs.Trainer(cs.tiny_cfg(run_dir + "-ep1", world=2, extra=MOE), seed=77)
    state = load(path, u.model, u.optimizer, u.scheduler, cfg=u.cfg)
    return {"ep2": ep2, "ep1": {"state": state, "logits": u.logits(), "losses_34": u.train(3, 4)}}


def test_moe_expert_parallel_resharding(tmp_path):
    out = run_ranks(_rank_moe, 2, str(tmp_path / "ep2"))
    for rank in range(2):
        _assert_close(out[rank]["ep1"]["logits"], out[rank]["ep2"]["logits"], f"EP=1 rank {rank} logits")
        assert out[rank]["ep1"]["losses_34"] == pytest.approx(out[rank]["ep2"]["losses_34"], rel=1e-5)
    assert out[0]["ep1"]["state"] == STATE


def _rank_dense_first_stage(run_dir: str):
    """PP=2 x EP=2 with the first stage's layers dense: its expert optimizer holds no parameter there."""
    from megatron_recipes.checkpoint import load

    extra = MOE + ["model.moe_first_dense_layers=2", "parallel.ep=2"]
    t = cs.Trainer(cs.tiny_cfg(run_dir, pp=2, world=4, extra=extra))
    t.train(1, 2)
    path = _save(t, Path(run_dir) / "checkpoints", 2, STATE)
    uninterrupted = t.train(3, 4)
    u = cs.Trainer(cs.tiny_cfg(run_dir, pp=2, world=4, extra=extra), seed=77)
    state = load(path, u.model, u.optimizer, u.scheduler, cfg=u.cfg)
    return {"state": state, "uninterrupted": uninterrupted, "resumed": u.train(3, 4)}


def test_resume_with_a_stage_that_holds_no_experts(tmp_path):
    """Rank 0 writes the optimizers' common state (the Adam step) for every rank. Its expert optimizer
    is empty here, so megatron-core (without Apex/TE) had no step to read; with a wrong one stage 1's
    experts would resume with the wrong bias correction."""
    out = run_ranks(_rank_dense_first_stage, 4, str(tmp_path / "run"))
    assert out[0]["state"] == STATE
    for rank in range(4):
        assert out[rank]["resumed"] == out[rank]["uninterrupted"], f"rank {rank} steps 3-4 after resume"
