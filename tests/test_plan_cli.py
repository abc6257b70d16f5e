"""`megatron-recipes plan`: the issue's done-when checks, run through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_recipes.cli import main
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.estimate.memory import estimate_memory
from megatron_recipes.validation.validate import validate

L70 = ["llama3_70b_pretrain", "cluster=h100_8gpu", "cluster.nodes=8"]


def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_llama70b_on_8_h100_nodes_prints_layout_groups_and_fits(capsys):
    rc, out, err = _run(capsys, *L70)
    assert rc == 0, err
    assert "world 64" in out and "layout" in out
    assert "parallel groups (megatron-core order tp-cp-ep-dp-pp)" in out
    assert "intra-node" in out and "intra-NVLink" in out
    assert "memory per GPU" in out and "pipeline bubble" in out
    assert "verdict: FITS" in out and "margin" in out


def test_llama70b_plan_json_marks_groups(capsys):
    rc, out, _ = _run(capsys, *L70, "--json")
    assert rc == 0
    plan = json.loads(out)
    lay, groups = plan["layout"], plan["groups"]
    assert (lay["world_size"], lay["tp"], lay["pp"], lay["cp"], lay["dp"]) == (64, 4, 4, 2, 2)
    assert groups["tp"]["groups"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # tp first in megatron-core's order
    assert groups["tp"]["intra_node"] and groups["tp"]["intra_nvlink_domain"] and groups["cp"]["intra_node"]
    assert not groups["dp"]["intra_node"] and not groups["pp"]["intra_node"]
    assert groups["pp"]["groups"][0] == [0, 16, 32, 48]  # pp last: stride world / pp
    assert plan["memory"]["fits"] and plan["memory"]["margin_gb"] > 0 and plan["valid"]
    assert 0 < plan["memory"]["bubble_fraction"] < 0.05
    assert plan["ranks"][5] == {"rank": 5, "node": 0, "tp": 1, "cp": 1, "dp": 0, "dp_cp": 1, "pp": 0}


def test_tp16_is_rejected_naming_tp_nvlink_and_valid_values(capsys):
    rc, out, err = _run(capsys, *L70, "parallel.tp=16")
    assert rc != 0
    assert "parallel.tp" in err and "NVLink domain" in err and "use parallel.tp in {1, 2, 4, 8}" in err
    assert "verdict" not in out and "parallel groups" not in out  # nothing planned


def test_search_lists_only_valid_fitting_layouts(capsys):
    rc, out, err = _run(capsys, *L70, "--search", "--json", "--top", "4")
    assert rc == 0, err
    result = json.loads(out)
    layouts = result["layouts"]
    assert len(layouts) == 4
    assert [r["step_s"] for r in layouts] == sorted(r["step_s"] for r in layouts)
    for row in layouts:
        cfg = compose_recipe("llama3_70b_pretrain", row["overrides"])
        assert validate(cfg) == [], row["overrides"]
        assert estimate_memory(cfg).fits
        assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp) == (row["tp"], row["pp"], row["cp"])
        assert "cluster.nodes=8" in row["overrides"]  # the user's overrides are kept


def test_search_table_prints_commands(capsys):
    rc, out, _ = _run(capsys, *L70, "--search", "--top", "2")
    assert rc == 0
    assert "fastest valid layouts" in out
    assert out.count("#1: megatron-recipes plan llama3_70b_pretrain") == 1 and "parallel.tp=" in out


def test_layout_that_only_overflows_memory_prints_plan_then_fails(capsys):
    rc, out, err = _run(capsys, *L70, "parallel.tp=1", "parallel.pp=1", "parallel.vpp=null", "parallel.cp=1", "parallel.sp=false")
    assert rc != 0
    assert "DOES NOT FIT" in out and "short by" in out
    assert "[memory.fits]" in err


def test_picture_png_and_svg(capsys, tmp_path):
    for name, magic in (("layout.png", b"\x89PNG"), ("layout.svg", b"<?xml")):
        path = tmp_path / name
        rc, out, err = _run(capsys, "mixtral_8x7b_pretrain", "cluster.nodes=4", "train.global_batch_size=128", "--picture", str(path))
        assert rc == 0, err
        assert path.read_bytes().startswith(magic) and path.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout.png", "layout.svg"]  # no temp files left


def test_picture_bad_format_fails_cleanly(capsys, tmp_path):
    rc, _, err = _run(capsys, "tiny_llama_cpu", "--picture", str(tmp_path / "layout.bmp"))
    assert rc != 0 and "unsupported format" in err
    assert list(tmp_path.iterdir()) == []


def test_show_config_and_all_groups(capsys):
    rc, out, _ = _run(capsys, "tiny_llama_cpu", "--show-config")
    assert rc == 0 and "parallel:" in out and "allow_inter_node_ep" in out
    rc, out, _ = _run(capsys, "mixtral_8x7b_pretrain", "--all-groups", "--json")
    plan = json.loads(out)
    assert len(plan["ranks"]) == 64
    for kind in ("tp", "dp", "pp", "ep", "edp"):
        group = plan["groups"][kind]
        assert len(group["groups"]) == group["count"]
        members = sorted(r for g in group["groups"] for r in g)
        assert members == list(range(64)), kind  # a partition of the world
    assert plan["groups"]["ep"]["size"] == 8 and plan["groups"]["ep"]["intra_node"]


def test_unknown_flag_and_missing_recipe(capsys):
    rc, _, err = _run(capsys, "tiny_llama_cpu", "--fast")
    assert rc != 0 and "--search" in err
    rc, _, err = _run(capsys)
    assert rc != 0 and "missing recipe" in err


def test_plan_shows_the_ep_all_to_all_exposed_and_hidden(capsys):
    """Qwen3-235B-A22B overlaps its EP all-to-all: plan says how much of it the other micro-batch hides;
    without the overlap, all of it is exposed and plan names the setting."""
    rc, out, err = _run(capsys, "qwen3_235b_a22b_pretrain")
    assert rc == 0, err
    assert "verdict: FITS" in out
    assert "EP all-to-all:" in out and "hidden behind the other micro-batch's computation" in out
    rc, out, _ = _run(capsys, "qwen3_235b_a22b_pretrain", "--json")
    st = json.loads(out)["step_time"]
    assert 0 < st["ep_hidden_s"] < st["ep_transfer_s"]
    assert 0 < st["breakdown_s"]["ep"] < st["ep_blocking_s"]
    rc, out, _ = _run(capsys, "qwen3_235b_a22b_pretrain", "parallel.overlap_moe_expert_parallel_comm=false",
                      "parallel.delay_wgrad_compute=false")
    assert "all exposed (parallel.overlap_moe_expert_parallel_comm=true" in out


@pytest.mark.parametrize("recipe", ["deepseek_v3_pretrain", "qwen3_30b_a3b_pretrain", "qwen3_235b_a22b_pretrain", "tiny_llama_cpu"])
def test_every_recipe_plans(capsys, recipe):
    rc, out, err = _run(capsys, recipe, "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["memory"]["fits"] and plan["step_time"]["step_s"] > 0


def test_console_script_runs(tmp_path):
    """The installed entry point, as users call it (a fresh process)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_recipes.cli", "plan", "tiny_llama_cpu", "--json"],
        capture_output=True, text=True, timeout=300, cwd=Path(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layout"]["world_size"] == 2


def test_rules_table(capsys):
    from megatron_recipes.validation.rules import RULES

    rc, out, _ = _run(capsys, "--rules", "--json")
    assert rc == 0
    table = json.loads(out)
    assert [r["id"] for r in table] == [r.id for r in RULES] and len(table) >= 40


def test_checkpoint_optimizer_format_follows_the_gather_and_plan_warns_when_forced(capsys):
    """auto saves dp_reshardable where the fully_reshardable gather (the fullest stage's fp32 params and
    Adam moments, on DP rank 0's host) is large; a forced fully_reshardable gets a warning naming the fix."""
    rc, out, _ = _run(capsys, *L70, "--json")
    plan = json.loads(out)
    fullest = max(s["params"] for s in plan["memory"]["stages"])
    ck = plan["checkpoint"]
    assert ck["gather_host_gb"] == pytest.approx(fullest * 12 / 1e9)
    assert ck["gather_large"] and ck["optimizer_format"] == "dp_reshardable" and ck["why"].startswith("auto:")
    rc, out, _ = _run(capsys, *L70, "checkpoint.optimizer_format=fully_reshardable")
    assert rc == 0 and "checkpoint optimizer format: fully_reshardable" in out
    assert "warning: every save gathers" in out and "checkpoint.optimizer_format=dp_reshardable" in out
    rc, out, _ = _run(capsys, "tiny_llama_cpu", "--json")
    tiny = json.loads(out)["checkpoint"]
    assert tiny["optimizer_format"] == "fully_reshardable" and not tiny["gather_large"]
    rc, out, err = _run(capsys, "tiny_llama_cpu", "checkpoint.optimizer_format=zero9")
    assert rc == 2 and "checkpoint.optimizer_format" in err + out
