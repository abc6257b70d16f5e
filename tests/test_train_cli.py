"""`megatron-recipes train` end to end on the CPU lane: outputs of a run, torchrun entry, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import train_support as ts

pytestmark = pytest.mark.slow



def test_console_script_trains_and_writes_every_output(tmp_path, cache):
    """The main job's command, shortened: TP=2 over 2 self-spawned CPU ranks."""
    exe = shutil.which("megatron-recipes")
    assert exe, "the console script is not installed (pip install -e .)"
    run_dir = tmp_path / "run"
    args = ts.command(run_dir, cache, [*ts.FAST[:3], "train.train_iters=30", "optimizer.lr_warmup_iters=3",
                                       "logging.log_interval=5", "logging.eval_interval=10", "logging.eval_iters=1",
                                       "checkpoint.save_interval=20"], 2, "tiny_llama_cpu")
    proc = subprocess.run([exe, "train", *args[3:]], capture_output=True, text=True, env=ts._env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    from megatron_recipes.config.compose import from_yaml

    cfg = from_yaml(run_dir / "config.yaml")  # the resolved recipe, reloadable
    assert cfg.parallel.tp == 2 and cfg.train.train_iters == 30 and cfg.cluster.gpus_per_node == 2

    lines = (run_dir / "log.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    steps = [r for r in records if r["type"] == "LOG"]
    assert [r["step"] for r in steps if "loss" in r["data"]] == [5, 10, 15, 20, 25, 30]
    for r in steps:
        assert {"timestamp", "datetime", "elapsedtime"} <= set(r)
    for r in (r for r in steps if "loss" in r["data"]):
        assert {"loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "mfu", "peak_mem_gib"} <= set(r["data"])
        assert r["data"]["tokens_per_sec"] > 0 and r["data"]["mfu"] == "n/a" and r["data"]["peak_mem_gib"] > 0
    losses = [r["data"]["loss"] for r in steps if "loss" in r["data"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert len([r for r in steps if "val_loss" in r["data"]]) == 3

    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    assert (ckpts / "iter_0000030" / "meta.json").is_file() and (ckpts / "iter_0000020" / "meta.json").is_file()
    assert "unigram entropy of the corpus" in proc.stdout


def test_torchrun_module_entry(tmp_path, cache):
    """`torchrun --nproc_per_node 2 -m megatron_recipes.train ...` is the same trainer."""
    run_dir = tmp_path / "run"
    args = ts.command(run_dir, cache, [*ts.FAST, "train.train_iters=2", "optimizer.lr_warmup_iters=1", "checkpoint.save=false"],
                      2, "tiny_llama_cpu")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "megatron_recipes.train"]
    proc = subprocess.run(launcher + args[3:], capture_output=True, text=True, env=ts._env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in ts.step_records(run_dir / "log.jsonl")] == [1, 2]
    page = (run_dir / "report.html").read_text()  # logging.plot=false: the report, without the layout picture
    assert "no picture: logging.plot=false" in page and "data:image/png" not in page


def test_wrong_number_of_ranks_is_a_clear_error(tmp_path, cache):
    run_dir = tmp_path / "run"
    args = ts.command(run_dir, cache, [*ts.FAST, "train.train_iters=2", "optimizer.lr_warmup_iters=1"], 2, "tiny_llama_cpu")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "megatron_recipes.train"]
    proc = subprocess.run(launcher + args[3:], capture_output=True, text=True, env=ts._env(), cwd=tmp_path, timeout=600)
    assert proc.returncode != 0
    assert "1 process(es) were started but the recipe's cluster" in proc.stderr
    assert not (run_dir / "log.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.vocab_size=256", "model.make_vocab_size_divisible_by=1"], "would index past the embedding"),
        (["data.kind=indexed", "data.blend=[/nonexistent/corpus]"], "missing /nonexistent/corpus.idx"),
        (["checkpoint.pretrained=/nonexistent/ckpt"], "does not exist"),
        (["optimizer=sgd", "optimizer.use_distributed_optimizer=true"], "distributed optimizer"),
    ],
)
def test_bad_input_fails_with_a_message_and_no_outputs(tmp_path, cache, overrides, message):
    run_dir = tmp_path / "run"
    run = ts.train(run_dir, cache, *ts.FAST, "train.train_iters=2", "optimizer.lr_warmup_iters=1", *overrides, nproc=2, self_spawn=True)
    assert run.returncode == 2, run.output[-3000:]  # found before any rank starts
    assert message in run.output, run.output[-3000:]
    assert "Traceback" not in run.output
    assert not (run_dir / "log.jsonl").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("launched", [False, True])
def test_one_composition_and_one_validation_per_process(tmp_path, cache, monkeypatch, launched):
    """Composing a recipe costs seconds of CPU: the entry composes once and validates once per process,
    started by hand (one rank) or by a launcher, and the trainer gets that very config."""
    from megatron_recipes.config import compose
    from megatron_recipes.training import cli, loop

    calls = {"compose": 0, "validate": 0}
    real_compose, real_validate = compose.compose_recipe, loop.validate

    def counted_compose(*a, **k):
        calls["compose"] += 1
        return real_compose(*a, **k)

    def counted_validate(*a, **k):
        calls["validate"] += 1
        return real_validate(*a, **k)

    ran = []

    def trainer(cfg, recipe, validated=False):  # what run() does before training, then stop
        if not validated:
            loop.validate(cfg, recipe)
        ran.append(cfg)
        return 0

    monkeypatch.setattr(compose, "compose_recipe", counted_compose)
    monkeypatch.setattr(loop, "validate", counted_validate)
    monkeypatch.setattr(loop, "run", trainer)
    for name in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if launched:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = ts.command(tmp_path / "run", cache, [*ts.FAST, "train.train_iters=0", "parallel.tp=1"], 1, "tiny_llama_cpu")
    assert cli.main(args[3:]) == 0
    assert calls == {"compose": 1, "validate": 1} and len(ran) == 1
    assert ran[0].train.train_iters == 0 and ran[0].run.dir == str(tmp_path / "run")
