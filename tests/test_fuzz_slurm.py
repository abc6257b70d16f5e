"""Fuzz of `slurm render`: hostile values in every string field of the cluster and run groups.

Each case either is refused with one RecipeError (exit 2 on the CLI), or renders a script that
``bash -n`` accepts, whose ``#SBATCH`` lines all precede its first command (sbatch stops reading there),
and that, run under bash with stand-in ``srun``/``scontrol`` and a ``pwned`` command on PATH, starts the
job (srun) and nothing else: no sentinel file. Most cases mutate one composed config in-process (Hydra
composition costs a fraction of a second per case); a few go through Hydra and the real CLI.
"""

from __future__ import annotations

import copy
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz_support import hostile_text
from launch_support import hydra_str, stub_env, stub_slurm_bin
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.slurm.launch_plan import build_plan, plan_for
from megatron_recipes.slurm.script import render_script

SEED, CASES = 20261201, 160
RECIPE, BASE = "tiny_llama_cpu", ("cluster=slurm_cpu", "parallel.tp=1")
SCALAR_FIELDS = ["cluster.name", "cluster.account", "cluster.partition", "cluster.time_limit",
                 "cluster.container_image", "cluster.container_workdir", "cluster.launcher", "cluster.preempt_signal",
                 "cluster.gpu_arch", "run.name", "run.dir", "logging.wandb_project"]
LIST_FIELDS = ["cluster.container_mounts", "cluster.sbatch_extra", "cluster.srun_extra"]
PWNED = "#!/bin/bash\ntouch \"$STUB_DIR/PWNED\"\necho \"pwned ran: $*\" >&2\n"


@pytest.fixture(scope="module")
def base_cfg():
    return compose_recipe(RECIPE, list(BASE))


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stub")
    stub_slurm_bin(folder / "bin")
    exe = folder / "bin" / "pwned"
    exe.write_text(PWNED)
    exe.chmod(0o755)
    return folder


def _set(cfg, dotted: str, value) -> None:
    group, name = dotted.split(".")
    setattr(getattr(cfg, group), name, value)


def _case(rng: random.Random, base, root: Path):
    """A config with 1-3 hostile fields, and the overrides a user would have typed for them."""
    cfg = copy.deepcopy(base)
    cfg.run.dir = str(root / "runs" / "r")
    overrides = list(BASE)
    if rng.random() < 0.3:  # a container run: run.dir must sit under a mount
        cfg.cluster.container_image = str(root / "img.sqsh")
        cfg.cluster.container_mounts = [f"{root}:{root}"]
    for dotted in rng.sample(SCALAR_FIELDS + LIST_FIELDS + ["cluster.env"], rng.randint(1, 3)):
        value = hostile_text(rng, control=rng.random() < 0.25)
        if dotted == "run.dir":
            value = str(root / "runs" / value.replace("/", "_"))
        if dotted in LIST_FIELDS:
            current = list(getattr(cfg.cluster, dotted.split(".")[1]))
            prefix = rng.choice(["--comment=", "--qos=", "", "-x ", f"{root}:"])
            value = current + [prefix + value]
        elif dotted == "cluster.env":
            value = {rng.choice(["NCCL_DEBUG", "MY_VAR", hostile_text(rng, control=False)]): hostile_text(rng)}
        _set(cfg, dotted, value)
        overrides.append(f"{dotted}={hydra_str(str(value))}")
    return cfg, overrides


def _header_is_intact(text: str) -> bool:
    """Every #SBATCH line comes before the first line sbatch would see as a command."""
    lines = text.splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    return all(i < first_command for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))


def _run_script(text: str, where: Path, stub: Path) -> subprocess.CompletedProcess:
    where.mkdir(parents=True, exist_ok=True)
    script = where / "job.sbatch"
    script.write_text(text)
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    (stub / "srun.args").unlink(missing_ok=True)
    return subprocess.run(["bash", str(script)], env=stub_env(stub), cwd=where, capture_output=True, text=True,
                          timeout=60)


def _check_rendered(text: str, where: Path, stub: Path, label: str) -> None:
    assert _header_is_intact(text), f"{label}: a #SBATCH line follows a command line"
    res = _run_script(text, where, stub)
    assert not (stub / "PWNED").exists(), f"{label}: a value ran as a command\n{res.stderr[-2000:]}"
    assert res.returncode == 0, f"{label}: the script failed ({res.returncode})\n{res.stderr[-2000:]}"
    assert (stub / "srun.args").exists(), f"{label}: srun (the job) did not start"


def test_hostile_cluster_and_run_values(base_cfg, stub, tmp_path):
    rng = random.Random(SEED)
    outcomes = {"refused": 0, "rendered": 0}
    for i in range(CASES):
        cfg, overrides = _case(rng, base_cfg, tmp_path / f"c{i}")
        label = f"case {i}: {overrides[len(BASE):]!r}"
        try:
            plan = plan_for(cfg, RECIPE, overrides, check_paths=False)
            text = render_script(plan)
        except RecipeError as exc:
            assert str(exc).strip(), label
            outcomes["refused"] += 1
            continue
        outcomes["rendered"] += 1
        _check_rendered(text, tmp_path / f"c{i}", stub, label)
    # the generator must exercise both paths, or the test proves little
    assert outcomes["refused"] >= 20 and outcomes["rendered"] >= 30, outcomes


@pytest.mark.parametrize("value", ["x\npwned\n#", "a'$(pwned)'b", 'q"; pwned; "', "`pwned`"])
def test_hostile_run_name_through_hydra(value, stub, tmp_path):
    """The issue's probe: run.name holding a newline (or shell syntax), composed by Hydra as typed."""
    overrides = [*BASE, f"run.dir={hydra_str(str(tmp_path / 'runs'))}", f"run.name={hydra_str(value)}",
                 f"logging.wandb_project={hydra_str(value)}"]
    try:
        plan = build_plan(RECIPE, overrides, check_paths=False)
    except RecipeError as exc:
        assert any(c in value for c in "\n\r"), f"refused a printable value: {exc}"
        assert "text.control_characters" in str(exc)
        return
    _check_rendered(render_script(plan), tmp_path, stub, value)


def test_cli_exit_codes(tmp_path):
    """End to end: a newline in run.name exits 2 with one message; a hostile printable name renders."""
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "megatron_recipes.cli", "slurm", "render", RECIPE, *BASE,
                               f"run.dir={hydra_str(str(tmp_path / 'runs'))}", *args, "--out",
                               str(tmp_path / "j.sbatch")], capture_output=True, text=True, cwd=tmp_path)

    bad = cli("run.name='x\ntouch owned\n#'")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "text.control_characters" in bad.stderr
    assert not (tmp_path / "j.sbatch").exists()
    good = cli(f"run.name={hydra_str('a $(touch owned) b')}")
    assert good.returncode == 0, good.stderr
    assert subprocess.run(["bash", "-n", str(tmp_path / "j.sbatch")]).returncode == 0
