"""`megatron-recipes check` end to end, as a user runs it: real ranks on gloo, real checkpoints.

Cheap cases only (CI): tiny_llama_lora (TP2 with adapters, built-in chat data), tiny_llama_sft_fsdp (Megatron-FSDP
zero3 at DP2, resharded by weights), a layout broken on purpose
(exit 1 with the first diverging step), a CP layout (proven with all_gather, the CPU lane's CP attention), a
CP layout the CPU lane cannot run (exit 2 with the reason, nothing trained), and one
shrunk big recipe (Qwen3-30B-A3B: PP2 x EP4 x DP4 with the distributed optimizer and overlapped reduction).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import run_cli

pytestmark = pytest.mark.slow

FAULTS = Path(__file__).parent / "faults"
SMALL = ["data.builtin_max_files=80", "data.builtin_vocab_size=600"]


def check(tmp_path: Path, recipe: str, *overrides: str, env=None, timeout: float = 900.0):
    """``megatron-recipes check``: forked from the session's server (tests/cli_support.py), or as a fresh
    interpreter when ``env`` changes ``PYTHONPATH`` (a fault injected at start-up)."""
    args = ["check", recipe, *overrides, "--dir", str(tmp_path / "check")]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    if "PYTHONPATH" in (env or {}):
        proc = subprocess.run([sys.executable, "-m", "megatron_recipes.cli", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout, cwd=str(tmp_path))
    else:
        proc = run_cli(args, env=full_env, timeout=timeout, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr



def test_tiny_lora_tp2_is_proven(tmp_path, cache):
    code, out = check(tmp_path, "tiny_llama_lora", f"data.cache_dir={cache}", *SMALL, "model.vocab_size=640")
    assert code == 0, out
    assert "verdict: PROVEN" in out and "TP2 PP1 CP1 DP1" in out and "resumed on one rank" in out
    assert "adapter dropout 0.05 -> 0" in out  # the recipe's dropout is off in both runs, and said
    assert "  reference, layout: done, 10 steps" in out  # each phase's progress, its runs together (plain line off a terminal)


def test_fsdp_sft_is_proven_against_the_plain_path_and_reshards_by_weights(tmp_path, cache):
    # Before: the one-rank reference ran Megatron-FSDP too (whose one-rank gradients were wrong), and the
    # full resume of an FSDP checkpoint on one rank was refused (exit 2).
    code, out = check(tmp_path, "tiny_llama_sft_fsdp", f"data.cache_dir={cache}", *SMALL, "model.vocab_size=640")
    assert code == 0, out
    assert "verdict: PROVEN" in out and "TP1 PP1 CP1 DP2" in out
    assert "runs without Megatron-FSDP" in out and "step-4 weights vs the one-rank run's" in out
    assert "  reweights exit 0" in out


def test_pipeline_layout_with_mtp_on_its_own_stage_is_proven(tmp_path, cache):
    """parallel.pipeline_layout with the MTP layer alone on a middle stage (as DeepSeek-V3's documented layout
    puts it). Before: megatron-core's default embedding group (first and last stage) all-reduced the untied
    output layer's gradient into the embedding's, TRAINS WRONG with the gradient norm 8% off at step 1."""
    code, out = check(tmp_path, "tiny_llama_cpu", f"data.cache_dir={cache}", *SMALL, "model.vocab_size=640",
                      "parallel=none", "parallel.pp=3", "cluster.gpus_per_node=3", "cluster.nvlink_domain=3",
                      "model.mtp_num_layers=1", "parallel.pipeline_layout='Etttt|m|L'", "train.global_batch_size=24")
    assert code == 0, out
    assert "verdict: PROVEN" in out and "TP1 PP3 CP1 DP1" in out
    assert "mtp_1_loss layout" in out and "mtp_1_loss resumed" in out  # the MTP layer's own loss is judged too


def test_wrong_pipeline_split_trains_wrong_at_step_1(tmp_path, cache):
    env = {"MR_TEST_FAULT": "pp_split", "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")])}
    code, out = check(tmp_path, "tiny_llama_cpu", f"data.cache_dir={cache}", *SMALL, "model.vocab_size=640",
                      "parallel=pp2", env=env)
    assert code == 1, out
    assert "TRAINS WRONG" in out and "first diverging step: 1" in out


def test_context_parallel_layout_is_proven_with_all_gather(tmp_path, cache):
    # the tiny model as if written for an H100 node with p2p CP (the default): the check runs it as all_gather
    code, out = check(tmp_path, "tiny_llama_cpu", f"data.cache_dir={cache}", *SMALL, "model.vocab_size=640",
                      "cluster=h100_8gpu", "cluster.gpus_per_node=2", "precision=bf16", "parallel.tp=1", "parallel.cp=2")
    assert code == 0, out
    assert "verdict: PROVEN" in out and "TP1 PP1 CP2 DP" in out and "resumed on one rank" in out
    assert "CP=2 proven with cp_comm_type=all_gather on the CPU lane" in out
    assert "the recipe's p2p exchange needs Transformer Engine and is validated only" in out


def test_context_parallel_layout_the_cpu_lane_cannot_run_exits_2(tmp_path):
    code, out = check(tmp_path, "tiny_llama_cpu", "parallel.tp=1", "parallel.cp=2", "parallel.cp_comm_type=all_gather",
                      "model.sliding_window=8")
    assert code == 2, out
    assert "CANNOT PROVE" in out and "CP=2" in out and "sliding" in out and "Nothing was trained" in out
    assert not (tmp_path / "check").exists()


def test_shrunk_qwen3_moe_pp2_ep4_is_proven(tmp_path, cache):
    # 16 of the recipe's 128 experts (CI time: the CPU lane runs a layer's experts one after another, so the
    # check's cost grows with their number): the layout under proof is unchanged (PP2 x EP4 x DP4, top-8
    # routing across expert ranks, 4 experts per rank, the distributed optimizer, overlapped reduction); that
    # the check keeps a recipe's expert count is test_check_units.py's to show
    code, out = check(tmp_path, "qwen3_30b_a3b_pretrain", f"data.cache_dir={cache}", "model.num_moe_experts=16")
    assert code == 0, out
    assert "DP 8 -> " in out and "EP 8 -> 4" in out and "verdict: PROVEN" in out
    assert "16 experts, top-8 kept" in out, out
