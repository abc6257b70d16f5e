"""The in-container entry: node checks, the torchrun/rank commands per node, and a real single-node launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_recipes._launch.entry import main as entry_main
from megatron_recipes._launch.entry import node_problems, plan_exec
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.slurm.dryrun import describe
from megatron_recipes.slurm.launch_plan import build_plan
from launch_support import REPO, cpu_overrides


@pytest.fixture(scope="module")
def two_nodes():
    return compose_recipe("tiny_llama_cpu", ["cluster=slurm_cpu", "parallel.tp=1"])


@pytest.fixture(scope="module")
def gpu_pmix():
    return compose_recipe("llama3_70b_pretrain", ["cluster.launcher=pmix"])


SLURM_ENV = {"SLURM_JOB_ID": "77", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "MASTER_ADDR": "n1",
             "MASTER_PORT": "20077"}


def test_healthy_node_has_no_problems(two_nodes):
    assert node_problems(two_nodes, SLURM_ENV, slurm=True, visible_gpus=None) == []


def test_multi_node_without_head_address_is_refused(two_nodes):
    env = {k: v for k, v in SLURM_ENV.items() if k != "MASTER_ADDR"}
    (problem,) = node_problems(two_nodes, env, slurm=True, visible_gpus=None)
    assert "MASTER_ADDR is not set" in problem and "localhost" in problem


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1"])
def test_loopback_head_address_is_refused_across_nodes(two_nodes, addr):
    (problem,) = node_problems(two_nodes, {**SLURM_ENV, "MASTER_ADDR": addr}, slurm=True, visible_gpus=None)
    assert "loopback" in problem


def test_allocation_size_must_match_recipe(two_nodes):
    (problem,) = node_problems(two_nodes, {**SLURM_ENV, "SLURM_JOB_NUM_NODES": "3"}, slurm=True, visible_gpus=None)
    assert "3 node(s)" in problem and "cluster.nodes=2" in problem


def test_gpu_recipe_on_a_node_without_enough_gpus(gpu_pmix):
    torchrun = compose_recipe("llama3_70b_pretrain")
    env = {**SLURM_ENV, "SLURM_JOB_NUM_NODES": "8"}
    (problem,) = node_problems(torchrun, env, slurm=True, visible_gpus=4)
    assert "sees 4 GPU(s)" in problem and "8 per node" in problem
    assert node_problems(gpu_pmix, env, slurm=True, visible_gpus=8) == []  # each pmix rank needs one


def test_torchrun_per_node_lines(two_nodes):
    head, _ = plan_exec(two_nodes, ["cfg.yaml"], {**SLURM_ENV, "SLURM_NODEID": "0"}, slurm=True, python="py")
    other, _ = plan_exec(two_nodes, ["cfg.yaml"], SLURM_ENV, slurm=True, python="py")
    assert head == ["py", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=n1:20077", "--rdzv-id=77", "--rdzv-conf=is_host=true", "--max-restarts=0",
                    "-m", "megatron_recipes.train", "cfg.yaml"]
    assert other == [a.replace("is_host=true", "is_host=false") for a in head]


def test_pmix_rank_environment(gpu_pmix):
    env = {**SLURM_ENV, "SLURM_JOB_NUM_NODES": "8", "SLURM_PROCID": "13", "SLURM_NTASKS": "64", "SLURM_LOCALID": "5",
           "SLURM_NTASKS_PER_NODE": "8(x8)"}
    argv, extra = plan_exec(gpu_pmix, ["cfg.yaml"], env, slurm=True, python="py")
    assert argv == ["py", "-m", "megatron_recipes.train", "cfg.yaml"]
    assert extra == {"RANK": "13", "WORLD_SIZE": "64", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "NODE_RANK": "1",
                     "MASTER_ADDR": "n1", "MASTER_PORT": "20077"}


def test_single_node_without_slurm_is_standalone(capsys):
    assert entry_main(["tiny_llama_cpu", "train.train_iters=5", "--print-only"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("--nnodes=1 --nproc-per-node=2 --standalone --max-restarts=0 -m megatron_recipes.train "
                         "tiny_llama_cpu train.train_iters=5")


def test_entry_refuses_a_bad_node(monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RecipeError, match="MASTER_ADDR is not set"):
        entry_main(["tiny_llama_cpu", "cluster=slurm_cpu", "parallel.tp=1"])


def test_print_only_prints_on_a_machine_that_could_not_run_it(monkeypatch, capsys):
    # Before: --print-only ran the node checks and failed on a machine without the job's GPUs (issue 29)
    for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert entry_main(["tiny_llama_cpu", "cluster=slurm_cpu", "parallel.tp=1", "--print-only"]) == 0
    out = capsys.readouterr().out
    assert "could not start it:" in out and "MASTER_ADDR is not set" in out and "exec: " in out


def test_dry_run_prints_the_entrys_own_lines(tmp_path):
    plan = build_plan("tiny_llama_cpu", cpu_overrides(tmp_path / "d r"))
    text = describe(plan, "job.sbatch")
    assert "# dry run: nothing was written or submitted" in text
    lines = text.splitlines()
    srun = next(ln for ln in lines if ln.startswith("srun "))
    assert "--nodes=2" in srun and "megatron_recipes._launch.entry --slurm" in srun
    node0 = lines[lines.index("# node 0 (head: hosts the c10d rendezvous store):") + 1]
    node1 = lines[lines.index("# node 1:") + 1]
    assert '"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"' in node0 and "is_host=true" in node0
    assert "is_host=false" in node1
    assert node0.endswith('-m megatron_recipes.train "$JOB_RUN_DIR/slurm/$SLURM_JOB_ID/config.yaml"')
    assert not (tmp_path / "d r").exists()  # nothing written


@pytest.mark.slow
def test_single_node_script_launches_real_ranks():
    """launch/run_single_node.sh without Slurm: torchrun starts 2 ranks that all-reduce (the probe)."""
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(["bash", str(REPO / "launch" / "run_single_node.sh"), "tiny_llama_cpu",
                          "--module", "megatron_recipes.slurm.probe"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[probe] ok: world=2 ranks on 1 node(s)" in res.stdout
