"""Real saves on one gloo rank: weights-only checkpoints, keep-last-K, checkpoint.load, and every refusal
(another model, a missing path, a damaged or weights-only checkpoint) as a RecipeError before any weight
changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import checkpoint_support as cs
from multiproc import run_ranks

pytestmark = pytest.mark.slow


def _params(model):
    return [p.detach().clone() for chunk in model for p in chunk.parameters()]


def _expect_error(fn, *needles):
    """Run ``fn``; return the RecipeError text (or say what happened instead)."""
    from megatron_recipes.config.errors import RecipeError

    try:
        fn()
    except RecipeError as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        return f"missing {missing} in: {text}" if missing else "ok"
    except Exception as exc:  # the wrong kind of error is a failure too
        return f"{type(exc).__name__} instead of RecipeError: {exc}"
    return "no error"


def _one_rank(tmp: str):
    from megatron_recipes import checkpoint as ck
    from megatron_recipes.checkpoint._start import resolve_load

    tmp = Path(tmp)
    out = {}
    t = cs.Trainer(cs.tiny_cfg(str(tmp / "run"), extra=["checkpoint.load=auto"]))
    root = ck.checkpoints_root(t.cfg)
    out["auto_empty"] = resolve_load(t.cfg)

    # Weights-only saves (what a conversion writes), keep_last=2 over four saves.
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            next(iter(t.model[0].parameters())).add_(1.0)  # each save holds different weights
        ck.save(root, step, t.model, None, None, {"step": step}, t.cfg, keep_last=2)
    out["dirs"] = sorted(p.name for p in root.iterdir())
    out["latest"] = ck.latest(root).name
    out["auto"] = resolve_load(t.cfg).name
    saved = _params(t.model)

    # Load weights into a freshly initialised model: bit-exact; the checkpoints root resolves to iter 4.
    fresh = cs.Trainer(t.cfg, seed=5)
    before = _params(fresh.model)
    ck.load_weights(root, fresh.model, fresh.cfg)
    out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(saved, _params(fresh.model)))
    out["weights_changed"] = not all(torch.equal(a, b) for a, b in zip(before, saved))

    # Refusals; none of them may touch the model.
    latest = root / "iter_0000004"
    snapshot = _params(fresh.model)
    out["resume_weights_only"] = _expect_error(
        lambda: ck.load(latest, fresh.model, fresh.optimizer, fresh.scheduler, cfg=fresh.cfg),
        "weights only",
        "checkpoint.pretrained",
    )
    out["missing_weights"] = _expect_error(lambda: ck.load_weights(tmp / "nope", fresh.model, fresh.cfg), "does not exist")
    out["missing_ckpt"] = _expect_error(lambda: ck.load(tmp / "nope", fresh.model), "does not exist")
    explicit = cs.tiny_cfg(str(tmp / "run"), extra=[f"checkpoint.load={tmp / 'nope'}"])
    out["missing_load"] = _expect_error(lambda: resolve_load(explicit), "checkpoint.load=", "does not exist")
    out["explicit_root"] = resolve_load(cs.tiny_cfg(str(tmp / "x"), extra=[f"checkpoint.load={root}"])).name
    out["none"] = resolve_load(cs.tiny_cfg(str(tmp / "run"), extra=["checkpoint.load=none"]))

    torn = tmp / "torn" / "iter_0000004"
    shutil.copytree(latest, torn)
    (torn / ".metadata").unlink()
    out["no_index"] = _expect_error(
        lambda: ck.load_weights(torn, fresh.model, fresh.cfg), "not a complete checkpoint", ".metadata"
    )
    truncated = tmp / "truncated" / "iter_0000004"
    shutil.copytree(latest, truncated)
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(snapshot, _params(fresh.model)))
    # The recorded sizes and hashes name the damaged file before megatron-core reads into the parameters
    out["truncated"] = _expect_error(
        lambda: ck.load_weights(truncated, fresh.model, fresh.cfg), "is damaged", f"{shard.name}: ", "bytes",
        "nothing was loaded",
    )
    # 4 KB overwritten in place, the size unchanged (issue 30, case 9): before, it loaded and the run went NaN
    overwritten = tmp / "overwritten" / "iter_0000004"
    shutil.copytree(latest, overwritten)
    shard = max(overwritten.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4096] = b"\xff" * 4096
    shard.write_bytes(bytes(data))
    out["overwritten"] = _expect_error(
        lambda: ck.load(overwritten, fresh.model), "is damaged", f"{shard.name}: its content changed since the save"
    )
    out["still_untouched"] = all(torch.equal(a, b) for a, b in zip(snapshot, _params(fresh.model)))
    out["verified"] = ck.verify_files(latest)
    out["recorded"] = sorted(ck.read_meta(latest)["files"])
    # every recorded file, one at a time: one byte flipped at a random place is named (the damage fuzz)
    import random

    rng, out["flips"] = random.Random(0), {}
    for name in out["recorded"]:
        flipped = tmp / "flipped" / name.replace("/", "_") / latest.name
        shutil.copytree(latest, flipped)
        data = bytearray((flipped / name).read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 0x01
        (flipped / name).write_bytes(bytes(data))
        out["flips"][name] = _expect_error(lambda: ck.verify_files(flipped), f"{name}: its content changed")

    out["bad_state"] = _expect_error(
        lambda: ck.save(tmp / "bad", 1, t.model, None, None, {"rng": {"n": object()}}, t.cfg, 1),
        "state['rng']['n']",
    )
    out["bad_state_wrote_nothing"] = not (tmp / "bad").exists()

    # Another model: the fingerprint names the fields; without cfg the tensor check names the shapes.
    other = cs.Trainer(cs.tiny_cfg(str(tmp / "other"), extra=["model.hidden_size=32", "model.ffn_hidden_size=96"]))
    other_before = _params(other.model)
    out["other_model"] = _expect_error(
        lambda: ck.load_weights(latest, other.model, other.cfg),
        "model.hidden_size: checkpoint 64, recipe 32",
        "model.ffn_hidden_size: checkpoint 128, recipe 96",
    )
    out["other_model_no_cfg"] = _expect_error(
        lambda: ck.load(latest, other.model),
        "does not fit this model",
        "checkpoint shape (256, 64), model (256, 32)",
    )
    out["other_untouched"] = all(torch.equal(a, b) for a, b in zip(other_before, _params(other.model)))
    return out


def test_weights_only_retention_and_refusals(tmp_path):
    (out,) = run_ranks(_one_rank, 1, str(tmp_path))
    assert out["auto_empty"] is None
    assert out["dirs"] == ["iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert out["latest"] == out["auto"] == "iter_0000004"
    assert out["weights_equal"] and out["weights_changed"]
    for key in (
        "resume_weights_only",
        "missing_weights",
        "missing_ckpt",
        "missing_load",
        "no_index",
        "truncated",
        "overwritten",
        "bad_state",
        "other_model",
        "other_model_no_cfg",
    ):
        assert out[key] == "ok", f"{key}: {out[key]}"
    assert out["explicit_root"] == "iter_0000004" and out["none"] is None
    assert out["untouched"] and out["other_untouched"] and out["bad_state_wrote_nothing"] and out["still_untouched"]
    assert out["verified"] is True  # the intact checkpoint's files are as recorded
    assert out["flips"] and all(v == "ok" for v in out["flips"].values()), out["flips"]
    assert ".metadata" in out["recorded"] and any(n.endswith(".distcp") for n in out["recorded"])
    assert "meta.json" not in out["recorded"] and "config.yaml" not in out["recorded"]
