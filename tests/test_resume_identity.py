"""A second start on a run dir continues the same run or says why not (issue 30, cases 6 and 7).

With the real one-rank trainer: a finished run told to train to its own step changes nothing; a start past
it is refused; a resume that changes the tokenizer, the data, a PEFT setting or the PEFT base is refused
naming the field, while what a segment may change (the learning rate here) is accepted and listed, and each
start's recipe is kept.
"""

from __future__ import annotations

import shutil

import pytest

import train_support as ts
from megatron_recipes import checkpoint

pytestmark = pytest.mark.slow

BASE = [*ts.FAST, "parallel.tp=1", "precision=fp32", "checkpoint.save_interval=1"]
LORA = [*ts.FAST, "parallel.tp=1", "train.seq_length=64", "checkpoint.save_interval=1", "peft.modules_to_save=[]"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    """A run trained to step 2 (each test works on its own copy)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    ts.train(run, cache, *BASE, "train.train_iters=2").check()
    return run


def _copy(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    return run


def _record(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name not in ("run.lock",)}


def test_a_finished_run_told_to_train_again_changes_nothing(finished, tmp_path, cache):
    # Before: the start resumed, trained nothing, exited 0 and rewrote config.yaml with the new setting, so the
    # report described a run that never trained that way.
    run = _copy(finished, tmp_path)
    before = _record(run)
    again = ts.train(run, cache, *BASE, "train.train_iters=2", "optimizer.lr=0.5")
    assert again.returncode == 0, again.output[-3000:]
    assert "nothing to train" in again.output and "is at step 2 = train.train_iters" in again.output
    assert _record(run) == before  # config.yaml, log.jsonl, checkpoints, report: byte for byte


def test_a_start_past_train_iters_is_refused(finished, tmp_path, cache):
    # Before: "steps 2 -> 1", nothing trained, exit 0, "done: 2 steps", config.yaml saying 1.
    run = _copy(finished, tmp_path)
    before = _record(run)
    short = ts.train(run, cache, *BASE, "train.train_iters=1")
    assert short.returncode == 2, short.output[-3000:]
    assert "past train.train_iters=1" in short.output and "checkpoint.load=<an earlier" in short.output
    assert _record(run) == before


def test_a_resume_lists_what_it_changes_and_keeps_each_starts_recipe(finished, tmp_path, cache):
    run = _copy(finished, tmp_path)
    first = (run / "config.yaml").read_text()
    constant = ["optimizer.lr_decay_style=constant", "optimizer.lr_warmup_iters=0"]
    more = ts.train(run, cache, *BASE, "train.train_iters=3", "optimizer.lr=0.5", *constant).check()
    assert "resuming with" in more.output and "optimizer.lr:" in more.output and "-> 0.5" in more.output, more.output[-3000:]
    # and the new lr is what the resumed step ran with (before: the loaded param groups kept the old max_lr on
    # megatron-core 0.16, so the listed change never happened; 0.19 raised a KeyError in load_state_dict)
    assert [r["data"]["lr"] for r in more.records() if r["step"] == 3] == [0.5], more.records()
    kept = sorted(p.name for p in (run / "configs").iterdir())
    assert kept == ["start_step_0000000.yaml", "start_step_0000002.yaml"]
    assert (run / "configs" / "start_step_0000000.yaml").read_text() == first
    assert "lr: 0.5" in (run / "config.yaml").read_text() == (run / "configs" / "start_step_0000002.yaml").read_text()


def test_a_resume_with_another_tokenizer_or_other_data_is_refused(finished, tmp_path, cache):
    # Before: resumed, with the loss jumping (4.4 -> 7.3 in the probe): every id meant another token.
    run = _copy(finished, tmp_path)
    other = ts.train(run, cache, *BASE, "train.train_iters=3", "data.builtin_vocab_size=500")
    assert other.returncode == 2, other.output[-3000:]
    assert "data.tokenizer: another tokenizer" in other.output and "data (blend)" in other.output
    assert checkpoint.step_of(checkpoint.latest(run / "checkpoints")) == 2
    # accepting new data does not accept another tokenizer
    still = ts.train(run, cache, *BASE, "train.train_iters=3", "data.builtin_vocab_size=500", "checkpoint.accept_new_data=true")
    assert still.returncode == 2 and "data.tokenizer: another tokenizer" in still.output
    assert "data (blend)" not in still.output


def test_a_lora_resume_refuses_another_base_and_another_alpha(tmp_path, cache):
    # Before: a LoRA run whose checkpoint.pretrained names the base run's checkpoints root resumed over the
    # base's newer checkpoint, and a changed peft.alpha resumed too (loss 3.7 -> 7.7 in the probe).
    base, lora = tmp_path / "base", tmp_path / "lora"
    ts.train(base, cache, *BASE, "train.train_iters=1").check()
    root = base / "checkpoints"
    lora_run = [*LORA, f"checkpoint.pretrained={root}"]
    ts.train(lora, cache, *lora_run, "train.train_iters=1", recipe="tiny_llama_lora").check()
    ts.train(base, cache, *BASE, "train.train_iters=2").check()  # the base run goes on: its root's latest moves
    moved = ts.train(lora, cache, *lora_run, "train.train_iters=2", recipe="tiny_llama_lora")
    assert moved.returncode == 2, moved.output[-3000:]
    first_base = checkpoint.iter_dir(root, 1)
    assert f"the adapters were trained on the base {first_base} (step 1)" in moved.output
    assert f"fix: set checkpoint.pretrained={first_base}" in moved.output
    pinned = [*LORA, f"checkpoint.pretrained={first_base}"]
    alpha = ts.train(lora, cache, *pinned, "train.train_iters=2", "peft.alpha=64", recipe="tiny_llama_lora")
    assert alpha.returncode == 2 and "peft.alpha: checkpoint 32.0, recipe 64.0" in alpha.output, alpha.output[-3000:]
    ok = ts.train(lora, cache, *pinned, "train.train_iters=2", "peft.dropout=0.1", recipe="tiny_llama_lora").check()
    assert "resumed from" in ok.output and checkpoint.step_of(checkpoint.latest(lora / "checkpoints")) == 2
