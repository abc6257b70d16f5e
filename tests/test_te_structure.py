"""Transformer Engine structure without a GPU: every shipped recipe x every precision group.

In a subprocess with an import stub of ``transformer_engine`` (tests/helpers/te_stub.py; only these
tests use it), tests/helpers/te_structure.py builds megatron-core's ``TransformerConfig`` exactly as a
GPU run with TE would (fusions decided for that machine, so megatron-core validates the fused RoPE, the
bias+activation fusion, FP8/FP4 fields) and the TE decoder block spec next to the local spec the CPU
lane trains with, checking that both store every norm under the same checkpoint keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch_support import REPO

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
PRECISIONS = sorted(p.stem for p in (REPO / "recipes" / "precision").glob("*.yaml"))
HELPER = Path(__file__).parent / "helpers" / "te_structure.py"


MOE_RECIPES = ("mixtral_8x7b_pretrain", "qwen3_30b_a3b_pretrain", "deepseek_v3_pretrain")
FLEX = [f"{r}/bf16/parallel.moe_dispatcher=flex/parallel.moe_flex_backend={b}" for r in MOE_RECIPES
        for b in ("deepep", "hybridep")]


def _case(recipe: str, precision: str) -> str:
    """``recipe/precision``, with the expert-parallel overlap off under fp32 parameters for a recipe that turns it
    on: megatron-core (and rule ep_overlap.precision) refuse that pair, and check's fp32 runs switch it off alike."""
    import yaml

    parallel = (yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text()) or {}).get("parallel") or {}
    if precision == "fp32" and parallel.get("overlap_moe_expert_parallel_comm"):
        return f"{recipe}/{precision}/parallel.overlap_moe_expert_parallel_comm=false/parallel.delay_wgrad_compute=false"
    return f"{recipe}/{precision}"


@pytest.fixture(scope="module")
def results():
    cases = {f"{r}/{p}": _case(r, p) for r in RECIPES for p in PRECISIONS} | {c: c for c in FLEX}
    proc = subprocess.run([sys.executable, str(HELPER), *cases.values()], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    return {key: found[case] for key, case in cases.items()}


def test_every_recipe_has_a_case():
    assert {"llama3_70b_pretrain", "deepseek_v3_pretrain", "mixtral_8x7b_pretrain", "tiny_llama_cpu"} <= set(RECIPES)
    assert {"bf16", "fp8_delayed", "fp8_tensorwise", "fp8_blockwise", "mxfp8", "nvfp4"} <= set(PRECISIONS)


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_config_and_spec_match_the_local_checkpoint_layout(results, recipe):
    failed = {case: r["error"] for case, r in results.items() if case.startswith(f"{recipe}/") and r.get("error")}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    for precision in PRECISIONS:
        r = results[f"{recipe}/{precision}"]
        assert r["spec"].startswith("TE"), f"{recipe}/{precision}: the TE spec was not built ({r['spec']})"
        assert {"gradient_accumulation_fusion", "bias_dropout_fusion"} <= set(r["fusions"])
        assert bool(r["fp8"]) == (precision.startswith("fp8") or precision == "mxfp8")
        assert r["fp4"] == ("e2m1" if precision == "nvfp4" else None)


@pytest.mark.parametrize("case", FLEX, ids=[c.split("/")[0] + "-" + c.rsplit("=", 1)[1] for c in FLEX])
def test_flex_dispatcher_config_and_spec_as_a_gpu_with_deep_ep_builds_them(results, case):
    """The flex dispatcher (DeepEP / HybridEP) as a GPU run configures it, through megatron-core's own
    TransformerConfig validation, with TE's grouped experts in the MoE layers; machine.flex_needs_deep_ep
    (tests/test_rules.py) refuses it where deep_ep does not import."""
    r = results[case]
    assert not r.get("error"), r
    assert r["dispatcher"] == "flex" and r["flex_backend"] == case.rsplit("=", 1)[1]
    assert r["experts"] == "TEGroupedMLP", r

