"""Sweeps (Hydra's multirun): ``-m`` with comma lists expands into one run per combination, each in its own
run dir; ``plan -m`` tabulates them; ``slurm submit -m`` submits one job per combination; ``train -m`` runs
them one after another."""

from __future__ import annotations

import json

import pytest

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.sweep import MAX_COMBINATIONS, expand, take_multirun


def test_comma_lists_expand_into_their_product_in_hydras_order():
    combos = expand(["parallel.tp=1,2", "train.train_iters=5", "optimizer.lr=1e-3,2e-3"], multirun=True)
    assert [c.chosen for c in combos] == [["parallel.tp=1", "optimizer.lr=1e-3"], ["parallel.tp=1", "optimizer.lr=2e-3"],
                                          ["parallel.tp=2", "optimizer.lr=1e-3"], ["parallel.tp=2", "optimizer.lr=2e-3"]]
    assert combos[1].overrides == ["parallel.tp=1", "train.train_iters=5", "optimizer.lr=2e-3"]  # positions kept
    assert combos[1].name == "parallel.tp=1,optimizer.lr=2e-3"
    assert [c.chosen for c in expand(["train.train_iters=range(1,4)"], True)] == [[f"train.train_iters={i}"] for i in (1, 2, 3)]
    assert expand(["peft.target_modules=[linear_qkv,linear_proj]"], False) is None  # a list value is one value
    assert [c.overrides for c in expand(["train.train_iters=3"], True)] == [["train.train_iters=3"]]  # -m, no sweep: one run


def test_a_sweep_without_multirun_and_an_oversized_sweep_are_refused():
    with pytest.raises(RecipeError, match="'parallel.tp=1,2' is a sweep") as info:
        expand(["parallel.tp=1,2"], multirun=False)
    assert "-m" in info.value.fix
    with pytest.raises(RecipeError, match=f"more than {MAX_COMBINATIONS}"):
        expand(["train.train_iters=range(0,1000)"], multirun=True)
    with pytest.raises(RecipeError, match="cannot read the overrides"):
        expand(["parallel.tp=(1"], multirun=True)


def test_each_combination_gets_its_own_run_dir_unless_run_dir_is_swept():
    combo = expand(["run.dir=runs/a", "parallel.tp=1,2"], True)[1]
    assert combo.with_run_dir("runs/a") == ["parallel.tp=2", 'run.dir="runs/a/parallel.tp=2"']
    swept = expand(["run.dir=runs/a,runs/b"], True)[1]
    assert swept.with_run_dir("runs/b") == ["run.dir=runs/b"]
    assert expand(["data.path=/d/x,/d/y"], True)[0].name == "data.path=_d_x"  # a folder name, not a path
    assert take_multirun(["tiny", "-m", "a=1,2"]) == (["tiny", "a=1,2"], True)
    assert take_multirun(["tiny", "--multirun"]) == (["tiny"], True) and take_multirun(["tiny"]) == (["tiny"], False)


def test_plan_multirun_tabulates_every_combination(capsys):
    from megatron_recipes.cli import main

    assert main(["plan", "llama3_8b_pretrain", "-m", "parallel.tp=1,2,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["combinations"]
    assert [r["combination"] for r in rows] == ["parallel.tp=1", "parallel.tp=2", "parallel.tp=4"]
    assert rows[0]["broken"] == ["memory.fits", "sp.needs_tp"] and not rows[0]["valid"]  # the recipe's sp needs TP > 1
    planned = [r for r in rows if "memory_gb" in r]
    assert [r["layout"].split()[0] for r in planned] == ["tp=2", "tp=4"] and all(r["valid"] for r in planned)
    # more tensor parallelism, less memory per GPU (weights and activations split further)
    memory = [r["memory_gb"] for r in planned]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == len(memory)
    assert main(["plan", "llama3_8b_pretrain", "-m", "parallel.tp=2,4"]) == 0
    out = capsys.readouterr().out
    assert "parallel.tp=2" in out and "parallel.tp=4" in out and "tokens/s/GPU" in out


def test_plan_multirun_with_no_valid_combination_fails_naming_the_rules(capsys):
    from megatron_recipes.cli import main

    assert main(["plan", "llama3_8b_pretrain", "-m", "parallel.tp=3,5"]) == 2
    captured = capsys.readouterr()
    assert "parallel.tp=3" in captured.out and "none of the 2 combinations" in captured.err


def test_slurm_submit_dry_run_shows_one_job_per_combination(tmp_path, capsys):
    from launch_support import cpu_overrides
    from megatron_recipes.cli import main

    base = tmp_path / "sweep"
    assert main(["slurm", "submit", "tiny_llama_cpu", *cpu_overrides(base), "-m", "optimizer.lr=1e-3,2e-3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for lr in ("1e-3", "2e-3"):
        assert f"sbatch --parsable {base}/optimizer.lr={lr}/slurm/tiny_llama_cpu.sbatch" in out, out
    assert out.count("# dry run: nothing was written or submitted") == 2 and "# sweep job 2/2: optimizer.lr=2e-3" in out
    assert not base.exists()
    assert main(["slurm", "render", "tiny_llama_cpu", *cpu_overrides(base), "-m", "optimizer.lr=1e-3,2e-3"]) == 2
    assert "one script" in capsys.readouterr().err


@pytest.mark.slow
def test_a_local_sweep_trains_each_combination_in_its_own_run_dir(tmp_path, data_cache):
    from train_support import FAST, SMALL_DATA, _env

    base = tmp_path / "sweep"
    from cli_support import run_cli

    command = ["train", "tiny_llama_cpu", "-m", "optimizer.lr=1e-3,2e-3", "parallel=none", "cluster.gpus_per_node=1",
               "train.train_iters=2", f"run.dir={base}", f"data.cache_dir={data_cache}", *SMALL_DATA, *FAST,
               "logging.plot=false", "logging.tensorboard=false"]
    done = run_cli(command, timeout=600, env=_env())  # no rendezvous of this process
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "=== sweep run 2/2: optimizer.lr=2e-3" in done.stdout
    for lr in ("1e-3", "2e-3"):
        run_dir = base / f"optimizer.lr={lr}"
        config = (run_dir / "config.yaml").read_text()
        assert f"lr: {float(lr)}" in config, config
        steps = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        assert any(r.get("step") == 2 for r in steps)
    assert sorted(p.name for p in base.iterdir()) == ["optimizer.lr=1e-3", "optimizer.lr=2e-3"]


def test_cfg_job_prints_each_combinations_recipe_without_running_it(capsys):
    from megatron_recipes.cli import main

    assert main(["train", "tiny_llama_cpu", "-m", "optimizer.lr=1e-3,2e-3", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert out.count("# sweep run optimizer.lr=") == 2 and "dir: runs/tiny_llama_cpu/optimizer.lr=2e-3" in out
    assert "lr: 0.002" in out and "=== sweep run" not in out  # printed, not trained
