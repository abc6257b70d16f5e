"""`megatron-recipes slurm ...` through the top-level dispatcher: render, --out, --dry-run, errors."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from megatron_recipes.cli import main
from megatron_recipes.config.schema import ClusterConfig
from megatron_recipes.slurm.launch_plan import build_plan
from megatron_recipes.slurm.script import render_script
from launch_support import REPO, cpu_overrides


def test_render_to_stdout_is_the_script(tmp_path, capsys):
    overrides = cpu_overrides(tmp_path / "r")
    assert main(["slurm", "render", "tiny_llama_cpu", *overrides]) == 0
    assert capsys.readouterr().out == render_script(build_plan("tiny_llama_cpu", overrides))


def test_render_out_writes_an_executable_script(tmp_path, capsys):
    out = tmp_path / "sub dir" / "job.sbatch"
    assert main(["slurm", "render", "tiny_llama_cpu", *cpu_overrides(tmp_path / "r"), "--out", str(out)]) == 0
    assert out.read_text().startswith("#!/bin/bash\n")
    assert os.access(out, os.X_OK)
    assert [p.name for p in out.parent.iterdir()] == ["job.sbatch"]  # no temporary left behind


def test_submit_dry_run_touches_nothing(tmp_path, capsys):
    run_dir = tmp_path / "dry"
    assert main(["slurm", "submit", "tiny_llama_cpu", *cpu_overrides(run_dir), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# dry run: nothing was written or submitted\n")
    assert f"sbatch --parsable {run_dir}/slurm/tiny_llama_cpu.sbatch" in out
    assert "# node 0 (head: hosts the c10d rendezvous store):" in out and "# node 1:" in out
    assert not run_dir.exists()


def test_submit_without_sbatch_says_where_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["slurm", "submit", "tiny_llama_cpu", *cpu_overrides(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "sbatch is not on PATH" in err and "render" in err


def test_bad_input_exits_2_with_the_field(tmp_path, capsys):
    assert main(["slurm", "render", "tiny_llama_cpu", *cpu_overrides(tmp_path, "cluster.require_account=true")]) == 2
    assert "cluster.account" in capsys.readouterr().err
    assert main(["slurm", "launch", "tiny_llama_cpu"]) == 2
    assert main(["slurm", "render", "tiny_llama_cpu", "--wait"]) == 2  # --wait belongs to submit


def test_example_cluster_settings_match_the_schema():
    loaded = OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.load(REPO / "slurm" / "example_cluster.yaml"))
    cluster = OmegaConf.to_object(loaded)
    assert cluster.require_account and cluster.container_mounts[1] == "/lustre/runs:/runs"


def test_a_gpu_cluster_names_its_container_or_says_none(tmp_path, capsys):
    # Before: a render without a container silently put this machine's venv Python into the job (issue 29).
    import sys

    base = ["llama3_8b_pretrain", f"run.dir={tmp_path / 'run'}", "--skip-path-checks"]
    assert main(["slurm", "render", *base]) == 2
    err = capsys.readouterr().err
    assert "[slurm.container_chosen]" in err and "cluster.container_image=none" in err
    assert main(["slurm", "render", *base, "cluster.container_image=none"]) == 0
    script = capsys.readouterr().out
    assert "--container-image" not in script and f"ENTRY=({sys.executable} " in script
    image = ["cluster.container_image=/images/x.sqsh", "cluster.container_mounts=[/lustre/runs:/runs]"]
    assert main(["slurm", "render", *base, *image]) == 2  # run.dir (a host path) is not under the mount target
    err = capsys.readouterr().err
    assert "[slurm.run_dir_mounted]" in err and "run.dir=/runs/<run name>" in err
