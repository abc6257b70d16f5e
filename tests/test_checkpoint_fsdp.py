"""Checkpoints under Megatron-FSDP (fsdp_dtensor format) on gloo ranks: resume, and resharding both ways.

Two process groups of 2 ranks. The first (A) trains under Megatron-FSDP zero3 and saves; the second starts
fresh (another initialisation, so every load must overwrite it) and runs phases one after another:
  A   FSDP zero3 DP=2   trains steps 1-2, saves; records logits, RNG draws, steps 3-4 losses (uninterrupted)
  B   FSDP zero3 DP=2   resumes it (checkpoint.load=auto): RNG draws, logits, steps 3-4 losses bit-identical
  C   TP=2 (no FSDP)    resuming its optimizer state is refused; it loads its weights: logits and step 3's loss (computed before any update) match A's;
                        trains on and saves a torch_dist checkpoint of its own
  D   PP=2 (no FSDP)    loads its weights (the second stage's layers 0-1 are the checkpoint's 2-3): logits match
  E   FSDP zero3 DP=2   loads C's torch_dist checkpoint into the bare model before wrapping: logits match C's at
                        its save; resuming C's optimizer state under FSDP is refused with a RecipeError
  F   FSDP TP=2 DP=1    resuming A's checkpoint (TP=1 DP=2) is refused (only the saved layout resumes)
A bf16 pair (A, B) checks that resume is exact with fp32 main weights too.
Tolerances: the same layout bit-exact (the same ranks do the same float operations in the same order); another
layout 1e-5 relative (TP/PP change float32 summation order, as in test_checkpoint_resharding.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow
FSDP = ["parallel.fsdp=true", "parallel.sharding=zero3"]
STATE = {"step": 2, "consumed_samples": 2 * cs.GBS}


def _save(trainer, root: Path, state):
    from megatron_recipes.checkpoint import save

    return save(root, state["step"], trainer.model, trainer.optimizer, trainer.scheduler, state, trainer.cfg,
                           keep_last=2)


def _optimizer_state(optimizer):
    """This rank's Adam state (moments, step) of the parameters it holds a non-empty shard of (a rank never
    steps an empty shard, so its ``step`` there is meaningless; see checkpoint/_fsdp.py _common_step)."""
    inner, out = optimizer.optimizer, {}
    for group in inner.param_groups:
        for i, param in enumerate(group["params"]):
            if (param.to_local() if hasattr(param, "to_local") else param).numel() == 0:
                continue
            for key, value in inner.state.get(param, {}).items():
                local = value.to_local() if hasattr(value, "to_local") else value
                out[f"{id(group)}.{i}.{key}"] = local.detach().clone() if torch.is_tensor(local) else local
    return list(out.values())


def _rank_a(run_dir: str, extra=()):
    t = cs.Trainer(cs.tiny_cfg(run_dir, world=2, extra=[*FSDP, *extra]))
    losses_12 = t.train(1, 2)
    path = _save(t, Path(run_dir) / "checkpoints", STATE)
    out = {"path": str(path), "draws": cs.rng_draws(), "logits": t.logits(), "losses_12": losses_12,
           "optim": _optimizer_state(t.optimizer), "lr": t.optimizer.param_groups[0]["lr"]}
    out["losses_34"] = t.train(3, 4)
    return out


def _resume_fsdp(run_dir: str, extra=()):
    from megatron_recipes.checkpoint import load
    from megatron_recipes.checkpoint._start import resolve_load

    t = cs.Trainer(cs.tiny_cfg(run_dir, world=2, extra=[*FSDP, *extra]), seed=77)
    path = resolve_load(t.cfg)
    state = load(path, t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    out = {"path": str(path), "state": state, "lr": t.optimizer.param_groups[0]["lr"], "draws": cs.rng_draws(),
           "optim": _optimizer_state(t.optimizer)}
    out["logits"] = t.logits()
    out["losses_34"] = t.train(3, 4)
    return out


def _weights_into(run_dir: str, ckpt: str, **layout):
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.checkpoint import load, load_weights

    t = cs.Trainer(cs.tiny_cfg(run_dir, world=2, **layout), seed=77)
    try:  # resuming the FSDP optimizer state in this layout is refused before any tensor is read
        load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
        t.refusal = None
    except RecipeError as exc:
        t.refusal = f"{exc.message} | fix: {exc.fix}"
    load_weights(Path(ckpt), t.model, t.cfg)
    t.optimizer.reload_model_params()  # the distributed optimizer's fp32 shards, as checkpointing.resume does
    return t


def _fsdp_from_torch_dist(run_dir: str, ckpt: str):
    """As the trainer does with checkpoint.pretrained under FSDP: load into the bare chunks, then wrap."""
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.runtime import distributed
    from megatron_recipes.training import optim, step
    from megatron_recipes.checkpoint import load, load_weights

    t = cs.Trainer.__new__(cs.Trainer)
    t.cfg = cs.tiny_cfg(run_dir, world=2, extra=FSDP)
    t.runtime = distributed.init_model_parallel(t.cfg)
    distributed.seed_everything(77)
    chunks = build_model_chunks(t.cfg)
    load_weights(Path(ckpt), chunks, t.cfg)
    t.model = optim.wrap_model(t.cfg, chunks)
    t.optimizer = optim.build_optimizer(t.cfg, t.model)
    t.scheduler = optim.build_scheduler(t.cfg, t.optimizer)
    optim.configure_schedule_hooks(t.cfg, t.model, t.optimizer)
    t.forward_step = step.make_forward_step(t.runtime.device, False)
    logits = t.logits()
    try:
        load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
        refusal = None
    except RecipeError as exc:
        refusal = f"{exc.message} | fix: {exc.fix}"
    return logits, refusal


def _rank_b(run_dir: str, ckpt: str):
    out = {"B": _resume_fsdp(run_dir)}
    t = _weights_into(run_dir + "/c", ckpt, tp=2)
    out["C"] = {"refusal": t.refusal, "logits": t.logits(), "loss_3": t.train(3, 4)[0]}  # fresh warm-up: step 3 has lr 0, 4 moves
    c_path = _save(t, Path(run_dir) / "c" / "checkpoints", {"step": 4, "consumed_samples": 4 * cs.GBS})
    out["C"]["logits_saved"] = t.logits()
    t = _weights_into(run_dir + "/d", ckpt, pp=2)
    out["D"] = {"logits": t.logits()}
    logits, refusal = _fsdp_from_torch_dist(run_dir + "/e", str(c_path))
    out["E"] = {"logits": logits, "refusal": refusal}
    out["F"] = {"refusal": _fsdp_other_layout(run_dir + "/f", ckpt)}
    return out


def _fsdp_other_layout(run_dir: str, ckpt: str):
    """Megatron-FSDP at TP=2 (DP=1) resuming the TP=1/DP=2 FSDP checkpoint: refused before any tensor is read."""
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.checkpoint import load

    t = cs.Trainer(cs.tiny_cfg(run_dir, tp=2, world=2, extra=FSDP), seed=77)
    try:
        load(Path(ckpt), t.model, t.optimizer, t.scheduler, cfg=t.cfg)
    except RecipeError as exc:
        return f"{exc.message} | fix: {exc.fix}"
    return None


def _rank_bf16(run_dir: str, ckpt: str):
    return _resume_fsdp(run_dir, extra=["precision=bf16"])


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp_ckpt")
    a = run_ranks(_rank_a, 2, str(run_dir), timeout=900)
    b = run_ranks(_rank_b, 2, str(run_dir), a[0]["path"], timeout=1500)
    return a, b


def test_fsdp_resume_is_bit_identical_to_the_uninterrupted_run(runs):
    a, b = runs
    assert a[0]["losses_34"][0] != a[0]["losses_12"][0], "training did not move the loss: a vacuous comparison"
    for ra, rb in zip(a, b):
        r = rb["B"]
        assert Path(r["path"]).name == "iter_0000002" and r["state"]["step"] == 2, r
        assert r["state"]["consumed_samples"] == STATE["consumed_samples"]
        assert torch.equal(r["logits"], ra["logits"])
        for name in ra["draws"]:  # each rank's own RNG streams came back
            assert ra["draws"][name] == r["draws"][name] if not torch.is_tensor(ra["draws"][name]) else torch.equal(
                ra["draws"][name], r["draws"][name]), name
        assert r["lr"] == ra["lr"] and len(r["optim"]) == len(ra["optim"]) > 0
        assert all(torch.equal(x, y) for x, y in zip(r["optim"], ra["optim"])), [
            (i, x.flatten()[:3], y.flatten()[:3]) for i, (x, y) in enumerate(zip(r["optim"], ra["optim"])) if not torch.equal(x, y)][:4]
        assert r["losses_34"] == ra["losses_34"], (r["losses_34"], ra["losses_34"])


def test_fsdp_resume_in_another_layout_is_refused(runs):
    for rb in runs[1]:
        refusal = rb["F"]["refusal"] or ""
        assert "resumed here only with the layout and number of ranks it was saved with" in refusal, refusal
        assert "checkpoint.pretrained=" in refusal, refusal


def test_fsdp_bf16_resume_is_bit_identical(tmp_path):
    """bf16 params with fp32 main weights (the DTensors Megatron-FSDP's state_dict gives are its main-weight
    shards): the resumed run continues exactly as the uninterrupted one."""
    a = run_ranks(_rank_a, 2, str(tmp_path), ["precision=bf16"], timeout=900)
    b = run_ranks(_rank_bf16, 2, str(tmp_path), a[0]["path"], timeout=900)
    for ra, rb in zip(a, b):
        assert torch.equal(rb["logits"], ra["logits"])
        assert all(torch.equal(x, y) for x, y in zip(rb["optim"], ra["optim"])) and len(rb["optim"]) > 0
        assert rb["losses_34"] == ra["losses_34"], (rb["losses_34"], ra["losses_34"])


def test_fsdp_checkpoint_loads_at_tp2_and_pp2(runs):
    a, b = runs
    want = a[0]["logits"]
    for rb in b:
        refusal = rb["C"]["refusal"] or ""
        assert "saved under Megatron-FSDP" in refusal and "checkpoint.pretrained=" in refusal, refusal
        assert _close(rb["C"]["logits"], want)
        assert rb["C"]["loss_3"] == pytest.approx(a[0]["losses_34"][0], rel=1e-5)
    last_stage = [rb["D"]["logits"] for rb in b if rb["D"]["logits"] is not None]
    assert len(last_stage) == 1 and _close(last_stage[0], want)


def test_torch_dist_checkpoint_loads_under_fsdp_and_its_optimizer_is_refused(runs):
    a, b = runs
    for rb in b:
        assert not _close(rb["C"]["logits_saved"], a[0]["logits"])  # C trained a step: E must see C's weights
        assert _close(rb["E"]["logits"], rb["C"]["logits_saved"])
        refusal = rb["E"]["refusal"] or ""
        assert "saved under a non-FSDP layout" in refusal and "fix: start from its weights with checkpoint.pretrained=" in refusal, refusal


def test_trainer_stops_and_resumes_under_fsdp_bit_identically(tmp_path):
    """The real trainer (torchrun ranks, built-in data, the loop's own save/resume): Megatron-FSDP zero3 over
    DP=2, stopped after 2 of 4 steps and restarted, logs exactly the history of an uninterrupted run."""
    import train_support as ts

    base = [*ts.FAST, "train.train_iters=4", "optimizer.lr_warmup_iters=2", "logging.eval_interval=2",
            "logging.eval_iters=1", "precision=fp32", "parallel=none", *FSDP, "checkpoint.save_interval=2"]
    cache = tmp_path / "cache"
    straight = ts.train(tmp_path / "straight", cache, *base, nproc=2).check()
    run_dir = tmp_path / "run"
    first = ts.train(run_dir, cache, *base, "train.exit_interval=2", nproc=2).check()
    assert (run_dir / "checkpoints" / "iter_0000002").is_dir() and "stopping at step 2" in first.output
    second = ts.train(run_dir, cache, *base, nproc=2).check()
    assert f"resumed from {run_dir / 'checkpoints' / 'iter_0000002'}" in second.output
    history = {key: second.series(key) for key in ("loss", "grad_norm", "lr", "val_loss")}
    want = {key: straight.series(key) for key in ("loss", "grad_norm", "lr", "val_loss")}
    assert len(history["loss"]) == 4 and history == want, (history, want)
