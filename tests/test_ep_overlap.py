"""Expert-parallel communication overlap (``parallel.overlap_moe_expert_parallel_comm``): megatron-core's combined
1F1B schedule trains exactly like the plain schedule on the CPU lane, and its requirements are refused before launch.

- The trainer (``python -m megatron_recipes.train``, real ranks on gloo) on the tiny MoE in bf16, overlap on and
  off from the same seed and data: EP2 (2 ranks, megatron-core's no-pipelining combined schedule) and PP2 x VPP2
  x EP2 with an MTP layer (4 ranks, its interleaved combined schedule) with a pipeline layout whose chunks hold 1
  and 3 MoE layers (odd counts, which a user reported deadlocking on GPUs: Megatron-LM #1810, #1852; the lane
  proves the schedule's pairing of layers, not GPU stream timing). Per-step losses, MTP losses, gradient norms
  and the final checkpoint (weights and optimizer state) must be bit-identical. Why exact, not a
  tolerance: the combined schedule runs the same operations on the same values in the same order per
  micro-batch; it only interleaves one micro-batch's forward with another's backward, layer by layer. Gradients
  still accumulate micro-batch after micro-batch, and where a layer's backward is split into separately run
  parts (combine, experts, dispatch, attention), each activation's gradient is a sum of two terms, which
  floating-point addition rounds the same in either order. Measured: identical on megatron-core 0.16.1 and 0.19.2.
- The same step through the trainer's own set-up (tests/checkpoint_support.Trainer) in rank processes, counting
  what megatron-core asks of the forward step: with the overlap every micro-batch is built as a schedule plan
  (``return_schedule_plan=True``), without it none is, so the equality above compares two different schedules.
- megatron-core refuses what the rules refuse (its TransformerConfig checks, read at 0.16.1 transformer_config.py
  1852-1926), and a recipe passing the rules is accepted: the rule table and the library agree.
- As a GPU run with Transformer Engine builds them (tests/helpers/ep_overlap_structure.py, a TE import stub):
  Qwen3-30B-A3B (PP2 x VPP2, EP8), DeepSeek-V3 (PP16 x VPP2 layout with MTP, EP64) and Qwen3-235B-A22B (its
  recipe as written: FP8, TP2 PP8 VPP4 EP32) with the overlap and
  deferred weight gradients pass the rule table on an H100 with TE 2.9, megatron-core's validation accepts
  their configs, DDP defers the gradient hooks with them, and the MoE layers use TE's grouped experts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

import train_support as ts
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError

HELPER = Path(__file__).parent / "helpers" / "ep_overlap_structure.py"
ON = "parallel.overlap_moe_expert_parallel_comm=true"
STEPS = 4
COMMON = [
    *ts.FAST,
    f"train.train_iters={STEPS}",
    "checkpoint.save=true",
    f"checkpoint.save_interval={STEPS}",
    "checkpoint.load=none",
    "parallel=none",
    "model=tiny_moe",
    "precision=bf16",
    "optimizer.lr_warmup_iters=1",
]
LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"]),
    # 6 MoE layers and an MTP layer on PP2 x VPP2: rank 0 holds [emb, 1 layer] and [1 layer], rank 1 [3 layers]
    # and [1 layer, MTP, loss]; 4 micro-batches per DP rank, so both ranks pair forwards with backwards after the
    # warm-up (megatron-core 0.16 overlaps an MTP layer only with PP > 1)
    "pp2_vpp2_ep2_mtp": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.vpp=2", "model.num_layers=6",
                             "model.mtp_num_layers=1", "parallel.pipeline_layout='Et|ttt|t|tmL'",
                             "train.micro_batch_size=1"]),
}


def _train(base: Path, cache: Path, name: str, nproc: int, extra: List[str], overlap: bool) -> ts.Run:
    flag = f"parallel.overlap_moe_expert_parallel_comm={str(overlap).lower()}"
    run = ts.train(base / f"{name}_{overlap}", cache, *COMMON, *extra, flag, nproc=nproc).check()
    assert len(run.series("loss")) == STEPS, run.output[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlapped_schedule_trains_bit_identically(tmp_path, cache, layout):
    nproc, extra = LAYOUTS[layout]
    plain, overlapped = (_train(tmp_path, cache, layout, nproc, extra, flag) for flag in (False, True))
    metrics = sorted({k for r in plain.records() for k in r["data"] if k in ("loss", "grad_norm") or k.startswith("mtp_")})
    assert ("mtp_1_loss" in metrics) == ("model.mtp_num_layers=1" in extra), metrics
    for key in metrics:
        assert overlapped.series(key) == plain.series(key), key
    losses = plain.series("loss")
    assert losses[-1] != losses[0], "training did not change the loss: the comparison would be vacuous"
    last = [ts.stored_tensors(r.run_dir / "checkpoints" / f"iter_{STEPS:07d}") for r in (plain, overlapped)]
    assert any(k.startswith("optimizer.") for k in last[0]), "the checkpoint holds no optimizer state"
    differ = ts.differing_tensors(*last)
    assert not differ, f"final checkpoints differ in {len(differ)} of {len(last[0])} tensors: {differ[:8]}"


# --- the combined schedule really runs --------------------------------------------------------------------


def _cfg(run_dir: str, overlap: bool, extra=()):
    from checkpoint_support import GBS, SEQ, VOCAB

    return compose_recipe("tiny_llama_cpu", [
        f"run.dir={run_dir}", "model=tiny_moe", "parallel=none", "precision=bf16", "parallel.ep=2",
        f"parallel.overlap_moe_expert_parallel_comm={str(overlap).lower()}", "model.hidden_size=64",
        "model.ffn_hidden_size=128", "model.moe_ffn_hidden_size=64", f"model.vocab_size={VOCAB}",
        "model.max_position_embeddings=64", f"train.seq_length={SEQ}", f"train.global_batch_size={GBS}",
        "train.micro_batch_size=1", "optimizer.lr=1e-2", "optimizer.lr_warmup_iters=1", *extra,
    ])


def _counted_steps(run_dir: str, overlap: bool, world: int, extra):
    """(rank) Two training steps through the trainer's set-up: losses, weight digest, and how the schedule
    called the forward step (micro-batch calls asking for a schedule plan, all calls)."""
    from checkpoint_support import Trainer, checksum

    trainer = Trainer(_cfg(run_dir, overlap, (f"cluster.gpus_per_node={world}", *extra)), seed=1234)
    inner, asked = trainer.forward_step, []

    def forward_step(data_iterator, model, return_schedule_plan=False):
        asked.append(return_schedule_plan)
        return inner(data_iterator, model, return_schedule_plan=return_schedule_plan)

    trainer.forward_step = forward_step
    losses = trainer.train(1, 2)
    config = trainer.model[0].config
    return losses, checksum(trainer.model), sum(asked), len(asked), config.overlap_moe_expert_parallel_comm


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [(2, ()), (4, ("parallel.pp=2", "parallel.vpp=2"))], ids=["ep2", "pp2_vpp2_ep2"])
def test_the_overlap_runs_megatron_cores_combined_schedule(tmp_path, world, extra):
    from multiproc import run_ranks

    plain = run_ranks(_counted_steps, world, str(tmp_path / "plain"), False, world, extra)
    overlapped = run_ranks(_counted_steps, world, str(tmp_path / "overlap"), True, world, extra)
    for (l0, w0, plans0, calls0, flag0), (l1, w1, plans1, calls1, flag1) in zip(plain, overlapped):
        assert (flag0, flag1) == (False, True)
        assert plans0 == 0 and calls0 > 0
        assert plans1 == calls1 == calls0, "with the overlap every micro-batch is a schedule plan"
        assert l1 == l0 and w1 == w0


# --- rules and megatron-core agree --------------------------------------------------------------------


OV = ["model=tiny_moe", "parallel=none", "parallel.ep=2", "precision=bf16", ON]
PP4 = ["parallel.pp=2", "cluster.gpus_per_node=4", "train.micro_batch_size=1"]
# rule id -> overrides breaking it (on OV), the words of megatron-core's refusal (None: 0.18 on accepts it)
REFUSED = {
    "ep_overlap.needs_ep": (["parallel.ep=1"], "expert model parallelism"),
    "ep_overlap.dispatcher": (["parallel.moe_dispatcher=allgather"], "alltoall/flex token dispatcher"),
    "ep_overlap.precision": (["precision=fp32"], "bf16 or fp16"),
    "ep_overlap.no_full_recompute": (["train.recompute=full"], "disable full recomputation"),
    "ep_overlap.pipeline_needs_vpp": (PP4, "virtual_pipeline_model_parallel_size must be specified"),
    "ep_overlap.mtp": (["model.mtp_num_layers=1"], "Pipeline model parallel size must be larger than 1"),
    "ep_overlap.delay_wgrad_needs_overlap": (
        ["parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=true"],
        "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute",
    ),
}


def _mcore_config(overrides):
    from megatron_recipes.models.transformer_config import build_transformer_config

    return build_transformer_config(compose_recipe("tiny_llama_cpu", overrides), use_te=False, cpu_init=True)


def _violations(overrides) -> List[str]:
    from megatron_recipes.validation.validate import validate

    return [v.rule_id for v in validate(compose_recipe("tiny_llama_cpu", overrides))]


def test_a_recipe_the_rules_pass_is_accepted_by_megatron_core():
    assert _violations(OV) == []
    config = _mcore_config(OV)
    assert config.overlap_moe_expert_parallel_comm and not config.delay_wgrad_compute
    assert _mcore_config([*OV, "parallel.delay_wgrad_compute=true"]).delay_wgrad_compute


@pytest.mark.parametrize("rule_id", sorted(REFUSED))
def test_megatron_core_refuses_what_the_rule_refuses(rule_id):
    from megatron_recipes.runtime import mcore_compat

    overrides, words = REFUSED[rule_id]
    assert rule_id in _violations([*OV, *overrides])
    if rule_id == "ep_overlap.mtp" and not mcore_compat.ep_overlap_mtp_needs_pipeline():
        assert _mcore_config([*OV, *overrides]).mtp_num_layers == 1  # 0.18 on: the rule is the oldest release's
        return
    with pytest.raises(RecipeError) as info:
        _mcore_config([*OV, *overrides])
    assert words in str(info.value)


def test_deferred_weight_gradients_are_refused_on_the_cpu_lane():
    """megatron-core's own linears compute weight gradients in backward (``backward_dw`` does nothing), so the
    CPU lane cannot honour ``delay_wgrad_compute``: ``train`` and ``check`` refuse it on the machine."""
    from megatron_recipes.models.capabilities import Machine, unmet_requirements

    cfg = compose_recipe("tiny_llama_cpu", [*OV, "parallel.delay_wgrad_compute=true"])
    cpu = Machine(cuda=False, transformer_engine=False, deep_ep=False, compute_capability=(0, 0))
    problems = unmet_requirements(cfg, cpu)
    assert len(problems) == 1 and "delay_wgrad_compute" in problems[0] and "no GPU" in problems[0]
    assert unmet_requirements(compose_recipe("tiny_llama_cpu", OV), cpu) == []  # the overlap itself runs here


def test_jobs_with_the_overlap_get_more_than_one_hardware_queue():
    """One hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, what TP needs before Blackwell) would run the
    communication stream's all-to-alls in line with the computation: the job sets 32 with the overlap."""
    from megatron_recipes.slurm.environment import cuda_device_max_connections

    def connections(*overrides):
        return {v.name: v.value for v in cuda_device_max_connections(compose_recipe("qwen3_30b_a3b_pretrain", list(overrides)))}

    assert connections() == {}  # TP1, CP1: no ordering requirement
    assert connections("parallel.tp=2", "parallel.sp=true") == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    for tp in ((), ("parallel.tp=2", "parallel.sp=true")):
        assert connections(*tp, "parallel.vpp=2", ON) == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def test_check_runs_the_plain_schedule_and_says_so(tmp_path):
    """`check` trains in fp32 (and its one-rank reference has no EP): the overlap goes off in both runs, with a
    note pointing here, instead of a refusal of the recipe."""
    from megatron_recipes.check.cli import plan_runs

    user = ["parallel.vpp=2", ON, "parallel.delay_wgrad_compute=true"]
    cfg, _, planned, notes, _ = plan_runs("qwen3_30b_a3b_pretrain", user, 8, 6, 3, out=tmp_path / "check")
    assert cfg.parallel.overlap_moe_expert_parallel_comm
    for name in ("reference", "layout"):
        over = planned[name]
        assert over.index("parallel.overlap_moe_expert_parallel_comm=false") > over.index(ON), name
    assert any("EP communication overlap -> off" in n for n in notes)


# --- as a GPU run with Transformer Engine builds it ----------------------------------------------------------


# recipe -> (overrides besides the overlap, the same layout without virtual stages)
STRUCTURE = {
    "qwen3_30b_a3b_pretrain": (["parallel.vpp=2"], ["parallel.vpp=null"]),
    "deepseek_v3_pretrain": ([], ["parallel.vpp=null", "parallel.pipeline_layout='Et*7|(t*8|)*6t*6mL'"]),  # as written
    "qwen3_235b_a22b_pretrain": ([], ["parallel.vpp=null"]),  # the published H100 run: overlap on as written
}


@pytest.fixture(scope="module")
def structure():
    cases = [json.dumps([recipe, [ON, "parallel.delay_wgrad_compute=true", *extra], without_vpp])
             for recipe, (extra, without_vpp) in STRUCTURE.items()]
    proc = subprocess.run([sys.executable, str(HELPER), *cases], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("recipe", sorted(STRUCTURE))
def test_gpu_config_with_overlap_and_deferred_wgrad(structure, recipe):
    r = structure[recipe]
    assert r["error"] is None, r
    assert r["violations"] == [], r
    assert r["overlap"] is True and r["delay_wgrad_compute"] is True and r["ddp_delay_wgrad_compute"] is True
    assert r["dispatcher"] == "alltoall" and r["experts"] == "TEGroupedMLP" and r["spec"].startswith("TE")
    assert r["vpp"] == r["recipe_vpp"] >= 2 and r["legacy_grouped_gemm"] is False
    assert r["refused_without_vpp"] and "virtual_pipeline_model_parallel_size" in r["refused_without_vpp"]
