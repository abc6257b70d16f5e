"""Bad cluster input is refused before anything is written or submitted, with the field and a fix."""

from __future__ import annotations

import pytest

from megatron_recipes.config.errors import RecipeError, ValidationError
from megatron_recipes.config import container_flags as container, slurm_syntax as checks
from megatron_recipes.slurm.cli import main as slurm_main
from megatron_recipes.slurm.launch_plan import build_plan
from launch_support import cpu_overrides, hydra_list, hydra_str

GPU = ["cluster.account=llm", "cluster.partition=batch", "run.dir=/lustre/runs/x"]


def _rules(exc: ValidationError) -> set:
    return {v.rule_id for v in exc.violations}


def _fails(recipe, overrides, rule, field, **kw):
    with pytest.raises(ValidationError) as info:
        build_plan(recipe, overrides, **kw)
    assert rule in _rules(info.value), info.value.render()
    assert field in info.value.render()
    assert "fix:" in info.value.render()
    return info.value


def test_account_and_partition_required_when_the_cluster_says_so(tmp_path):
    err = _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.require_account=true"), "slurm.account",
                 "cluster.account")
    assert "cluster.partition" in err.render()
    build_plan("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.require_account=true", "cluster.account=a",
                                               "cluster.partition=p"))


def test_container_flags_without_an_image(tmp_path):
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, f"cluster.container_mounts={hydra_list([str(tmp_path)])}"),
           "slurm.container_image", "cluster.container_mounts")
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.container_workdir=/w"), "slurm.container_image",
           "cluster.container_workdir")


def _container(tmp_path, mounts, *extra):
    image = tmp_path / "img.sqsh"
    image.write_bytes(b"hsqs")
    return cpu_overrides(tmp_path, f"cluster.container_image={hydra_str(str(image))}",
                         f"cluster.container_mounts={hydra_list(mounts)}", *extra)


def test_mount_source_must_exist_when_checkable(tmp_path):
    missing = tmp_path / "no such dir"
    overrides = _container(tmp_path, [str(tmp_path), f"{missing}:/data"])
    _fails("tiny_llama_cpu", overrides, "slurm.mount_source", str(missing))
    build_plan("tiny_llama_cpu", overrides, check_paths=False)  # rendering away from the cluster


def test_mount_sources_on_filesystems_absent_here_are_not_judged(tmp_path):
    plan = build_plan("tiny_llama_cpu", _container(tmp_path, [str(tmp_path), "/no-such-fs-xyz/data:/data"]))
    assert [m.source for m in plan.mounts] == [str(tmp_path), "/no-such-fs-xyz/data"]


@pytest.mark.parametrize("entry, words", [
    ("/a,b:/c", "','"),
    ("/a:/b:ro:extra", "':'"),
    ("relative/path:/data", "not an absolute path"),
    ("/data:relative", "not an absolute path"),
])
def test_mount_syntax_pyxis_cannot_parse(tmp_path, entry, words):
    err = _fails("tiny_llama_cpu", _container(tmp_path, [str(tmp_path), entry]), "slurm.mount_syntax",
                 "cluster.container_mounts")
    assert words in err.render()


def test_local_image_must_exist(tmp_path):
    overrides = cpu_overrides(tmp_path, f"cluster.container_image={hydra_str(str(tmp_path / 'missing.sqsh'))}",
                              f"cluster.container_mounts={hydra_list([str(tmp_path)])}")
    _fails("tiny_llama_cpu", overrides, "slurm.container_image", "missing.sqsh")


def test_run_dir_must_be_mounted_into_the_container(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    _fails("tiny_llama_cpu", _container(tmp_path, [f"{other}:/other"]), "slurm.run_dir_mounted", "run.dir")


def test_node_count_must_match_the_layout(tmp_path):
    # tp=2 on 3 nodes x 1 rank: 3 ranks cannot be split into TP pairs
    with pytest.raises(ValidationError) as info:
        build_plan("tiny_llama_cpu", ["cluster=slurm_cpu", "cluster.nodes=3", f"run.dir={tmp_path}"])
    assert "cluster.nodes" in info.value.render()


def test_gpus_per_node_must_match_the_layout():
    # llama3_70b: tp=4 on HGX nodes with 2 GPUs each -> TP groups would leave the node's NVLink domain
    with pytest.raises(ValidationError) as info:
        build_plan("llama3_70b_pretrain", GPU + ["cluster.gpus_per_node=2", "cluster.nvlink_domain=2",
                                                 "cluster.nodes=32"])
    assert "parallel.tp" in info.value.render() and "nvlink_domain" in info.value.render()


def test_time_limit_and_signal_lead(tmp_path):
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.time_limit=soon"), "slurm.time_limit",
           "cluster.time_limit")
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.time_limit=00:05:00", "cluster.preempt_signal_lead_s=300"),
           "slurm.preempt_lead", "cluster.preempt_signal_lead_s")
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.preempt_signal=KILL"), "slurm.preempt_signal",
           "cluster.preempt_signal")


def test_extras_cannot_contradict_the_recipe(tmp_path):
    err = _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.sbatch_extra=" + hydra_list(["--nodes=4"])), "slurm.extra_owned",
                 "cluster.sbatch_extra")
    assert "cluster.nodes" in err.render()
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.srun_extra=" + hydra_list(["--container-image=x"])),
           "slurm.extra_owned", "cluster.srun_extra")
    build_plan("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.sbatch_extra=" + hydra_list(["--qos=high"])))


def test_launcher_must_be_known(tmp_path):
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.launcher=mpirun"), "slurm.launcher", "cluster.launcher")


def test_percent_in_run_dir_is_refused(tmp_path):
    _fails("tiny_llama_cpu", cpu_overrides(tmp_path / "100%"), "slurm.run_dir", "run.dir")


def test_every_problem_is_reported_together(tmp_path):
    with pytest.raises(ValidationError) as info:
        build_plan("tiny_llama_cpu", cpu_overrides(tmp_path, "cluster.require_account=true", "cluster.launcher=x",
                                                   "cluster.time_limit=later"))
    assert {"slurm.account", "slurm.launcher", "slurm.time_limit"} <= _rules(info.value)


def test_recipe_and_launch_rules_are_reported_in_one_pass(tmp_path):
    """One ValidationError lists the recipe's own broken rules and the Slurm ones together."""
    with pytest.raises(ValidationError) as info:
        build_plan("tiny_llama_cpu", cpu_overrides(tmp_path, "optimizer.min_lr=1.0", "cluster.launcher=x"))
    assert {"optimizer.learning_rate", "slurm.launcher"} <= _rules(info.value)


def test_cli_writes_nothing_on_bad_input(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    with pytest.raises(RecipeError):
        slurm_main(["render", "tiny_llama_cpu", *cpu_overrides(tmp_path, "cluster.require_account=true"),
                    "--out", str(out)])
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("10:30", 630), ("04:00:00", 14400), ("2-00", 172800), ("1-02:03", 93780),
    ("1-00:00:05", 86405), ("UNLIMITED", None),
])
def test_slurm_time_formats(text, seconds):
    assert checks.time_limit_seconds(text) == seconds


def test_host_path_through_the_deepest_mount():
    mounts = container.parse_mounts(["/lustre:/mnt", "/scratch/me:/mnt/scratch", "/data"])
    assert container.to_host_path("/mnt/runs/a", mounts) == "/lustre/runs/a"
    assert container.to_host_path("/mnt/scratch/r", mounts) == "/scratch/me/r"
    assert container.to_host_path("/data", mounts) == "/data"
    assert container.to_host_path("/elsewhere", mounts) == "/elsewhere"
