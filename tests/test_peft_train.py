"""Fine-tuning with the real trainer: the fine-tuning recipes on an SFT set, from an imported HF model.

Each run is ``megatron_recipes.train`` started as a user would (torchrun ranks on the CPU lane), with
the recipe's own settings except a short schedule; numbers come from the run's ``log.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import peft_support as ps
import train_support as ts

pytestmark = pytest.mark.slow

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "rain", "snow"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-train")
    base = ps.run_ranks(1, ps.import_hf_llama, str(root))[0]
    sft = root / "train.jsonl"
    g = torch.Generator().manual_seed(0)
    with open(sft, "w", encoding="utf-8") as handle:
        for _ in range(96):  # answers follow a fixed rule the model can pick up: the word, three times
            word = WORDS[int(torch.randint(len(WORDS), (1,), generator=g))]
            handle.write(json.dumps({"input": f"say {word}", "output": f"{word} {word} {word}"}) + "\n")
    return root, base, sft


def _train(setup, recipe: str, nproc: int, steps: int, *extra: str) -> ts.Run:
    root, base, sft = setup
    overrides = [
        *ts.FAST,
        "train.seq_length=64",
        f"train.train_iters={steps}",
        f"checkpoint.pretrained={base}",
        f"data.sft_path={sft}",
        f"checkpoint.save_interval={steps}",
        *extra,
    ]
    return ts.train(root / f"run_{recipe}_{nproc}", root / "cache", *overrides, nproc=nproc, recipe=recipe).check()


def _falls(losses, margin: float = 0.1) -> bool:
    return len(losses) >= 6 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - margin


def test_lora_loss_falls_and_checkpoints_hold_adapters(setup):
    # adapters only (the shipped recipe also trains the LM head: test_peft_config covers that)
    run = _train(setup, "tiny_llama_lora", 2, 12, "peft.modules_to_save=[]")
    losses = run.series("loss")
    assert _falls(losses), losses
    assert "trainable params: 131,072 || all params: 1,967,232 || trainable%: 6.6628" in run.output
    from megatron_recipes.convert.dcp_io import CheckpointReader
    from megatron_recipes.checkpoint import latest

    keys = [k for k in CheckpointReader(latest(run.run_dir / "checkpoints")).tensors() if not k.startswith("optimizer")]
    assert keys and all(k.endswith(("lora_a", "lora_b")) for k in keys)


def test_qlora_trains_on_a_smaller_base(setup):
    run = _train(setup, "tiny_llama_qlora", 1, 12, "parallel=none")
    assert _falls(run.series("loss")), run.series("loss")
    line = next(ln for ln in run.output.splitlines() if ln.startswith("base linear weights"))
    assert float(line.split("(")[1].split("x")[0]) >= 3.5, line


def test_ptuning_trains(setup):
    run = _train(setup, "tiny_llama_ptuning", 2, 12)
    assert _falls(run.series("loss")), run.series("loss")


def test_full_sft_then_export_loads_in_transformers(setup):
    from transformers import AutoModelForCausalLM

    run = _train(setup, "tiny_llama_sft", 2, 6)
    assert "trainable params" not in run.output  # full SFT: every parameter trains
    out = run.run_dir.parent / "sft_hf"
    ps.run_ranks(1, _export, str(run.run_dir / "checkpoints"), str(out))  # the CLI checks logits itself
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(str(Path(setup[0]) / "hf"), dtype=torch.float32)
    tokens = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tuned, before = model(tokens).logits, original(tokens).logits
    assert torch.isfinite(tuned).all() and (tuned - before).abs().max() > 1e-3  # SFT changed the weights


def _export(ckpt: str, out: str) -> int:
    from megatron_recipes.convert.cli import main

    return main(["export", f"ckpt_dir={ckpt}", f"hf_dir={out}", "--quiet", "--verify"])
