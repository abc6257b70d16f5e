"""The command line answers help, listing and mistakes without importing torch or megatron-core (issue 29):
those take seconds, and a user waiting on `--help` or a typo should not. The process-wide patches are still
applied before megatron-core is first imported. (Timings are a benchmark's job; this checks the imports.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from megatron_recipes.cli import main
rc = main(json.loads(sys.argv[1]))
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "mcore": "megatron.core" in sys.modules}))
"""

QUICK = [
    (["--help"], 0),
    (["plan", "--help"], 0),
    (["report", "--help"], 0),
    (["train", "--help"], 0),
    (["check", "--help"], 0),
    (["list"], 0),
    (["list", "parallel"], 0),
    (["list", "paralel"], 2),
    (["plan", "tiny_llama_cpu", "--serch"], 2),
    (["plan", "tiny_llama_cpu", "train.train_iter=3"], 2),
    (["plan", "no_such_recipe"], 2),
    (["train", "tiny_llama_cpu", "--cfg", "job"], 0),
    (["plan", "tiny_llama_cpu", "--cfg", "job", "parallel.tp=1"], 0),
]


def _run(argv):
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout + proc.stderr


@pytest.mark.parametrize("argv,rc", QUICK, ids=[" ".join(a) for a, _ in QUICK])
def test_help_listing_and_mistakes_import_neither_torch_nor_megatron_core(argv, rc):
    got, output = _run(argv)
    assert got == {"rc": rc, "torch": False, "mcore": False}, output[-2000:]


def test_a_typo_gets_the_key_it_meant():
    _, output = _run(["plan", "tiny_llama_cpu", "train.train_iter=3"])
    assert "did you mean train.train_iters?" in output and "+train.train_iter" not in output, output[-2000:]


def test_the_process_patches_are_applied_when_megatron_core_is_first_imported():
    probe = PROBE.replace('print(json.dumps({', 'from megatron_recipes.runtime import patches\nprint(json.dumps({"applied": sorted(patches._APPLIED), ')
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(["plan", "tiny_llama_cpu"])], capture_output=True,
                          text=True, timeout=300)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["mcore"], proc.stderr[-2000:]
    from megatron_recipes.runtime.patches import rows

    assert set(got["applied"]) >= {p.name for p in rows("process") if not p.on_object}, got


def test_cfg_job_prints_the_resolved_recipe_that_composes_back(tmp_path):
    from megatron_recipes.config.compose import compose_recipe, from_yaml

    _, output = _run(["train", "tiny_llama_cpu", "--cfg", "job", "parallel.tp=1", "train.train_iters=7"])
    text = output[: output.rindex("{")]  # the YAML, then the probe's JSON line
    (tmp_path / "config.yaml").write_text(text)
    assert from_yaml(tmp_path / "config.yaml") == compose_recipe("tiny_llama_cpu", ["parallel.tp=1", "train.train_iters=7"])
