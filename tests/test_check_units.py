"""`megatron-recipes check` without processes: the verdict, DP-first scaling, and that every shrunk
recipe (layout and one-rank reference) passes the rule table with the recipe's degrees kept."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from megatron_recipes.check import compare
from megatron_recipes.check.cli import context_parallel_unproven, plan_runs
from megatron_recipes.check.shrink import Degrees, fit_degrees, seq_length
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.validation.validate import validate


def test_judge_equal_within_tolerance():
    s = compare.Series("loss", [8.0, 7.5, 7.0], [8.0, 7.5 * (1 + 5e-6), 7.0])
    assert compare.judge([s], 1e-5).equal
    assert not compare.judge([s], 1e-6).equal


def test_judge_names_the_first_diverging_step_across_metrics():
    loss = compare.Series("loss", [8.0, 7.5, 7.1, 6.0], [8.0, 7.5, 7.0, 6.5])
    norm = compare.Series("grad_norm", [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0])
    v = compare.judge([norm, loss], 1e-5)
    assert not v.equal and v.first_diverging_step == 3 and v.metric == "loss"
    assert compare.judge([compare.Series("loss", [1.0], [1.0, 2.0])], 1e-5).first_diverging_step is None


def test_judge_nan_is_never_equal():
    assert not compare.judge([compare.Series("loss", [float("nan")], [1.0])], 1.0).equal


def test_table_shows_both_runs_and_the_difference():
    text = compare.table([compare.Series("loss", [2.0, 1.0], [2.0, 1.5])], "layout", "1-rank")
    assert "loss layout" in text and "1.5" in text and "3.3e-01" in text


def test_fit_keeps_a_layout_that_fits():
    d = Degrees(tp=2, pp=1, cp=2, ep=1, etp=2, dp=2)
    assert fit_degrees(d, 8) == (d, [])


def test_fit_scales_dp_first_then_says_which_degree_shrank():
    fitted, notes = fit_degrees(Degrees(tp=1, pp=2, cp=1, ep=8, etp=1, dp=8), 8)  # Qwen3-30B-A3B: 16 ranks
    assert notes[0].startswith("DP 8 -> ")
    assert (fitted.pp, fitted.ep, fitted.world) == (2, 4, 8) and "EP 8 -> 4" in notes[1]
    only_dp, notes = fit_degrees(Degrees(tp=2, pp=1, cp=1, ep=1, etp=2, dp=8), 8)
    assert (only_dp.tp, only_dp.dp) == (2, 4) and len(notes) == 1


SHIPPED = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", SHIPPED)
def test_shrunk_recipe_passes_every_rule(recipe):
    """Every shipped recipe's shrunk layout and reference are valid (QLoRA's NF4 blocks still tile each
    rank's input features, offloading is off on the CPU lane, ...)."""
    cfg, small, planned, notes, _ = plan_runs(recipe, [], 8, 6, 4)
    assert small.degrees.world <= 8
    for name in ("layout", "reference"):
        shrunk = compose_recipe(recipe, planned[name])
        bad = [f"[{v.rule_id}] {v.message}" for v in validate(shrunk)]
        assert not bad, f"{recipe} {name}: {bad}"
    layout = compose_recipe(recipe, planned["layout"])
    p = layout.parallel
    assert (p.tp, p.pp, p.cp, p.ep) == (small.degrees.tp, small.degrees.pp, small.degrees.cp, small.degrees.ep)
    assert p.vpp == cfg.parallel.vpp and p.sp == cfg.parallel.sp
    assert layout.model.num_moe_experts == cfg.model.num_moe_experts
    assert layout.model.moe_router_topk == cfg.model.moe_router_topk


def test_precision_settings_on_top_of_the_group_do_not_outlive_the_fp32_swap():
    """A recipe that gathers FP8 weights (precision.fp8_param_gather=true, as the published FP8 runs do) is checked
    in float32: that setting must go with its group, or the shrunk runs break precision rules."""
    _, _, planned, notes, _ = plan_runs("qwen3_235b_a22b_pretrain", ["precision.fp8_param_gather=true"], 8, 6, 4)
    for name in ("layout", "reference"):
        shrunk = compose_recipe("qwen3_235b_a22b_pretrain", planned[name])
        assert shrunk.precision.params_dtype == "fp32" and not shrunk.precision.fp8_param_gather
        bad = [f"[{v.rule_id}] {v.message}" for v in validate(shrunk)]
        assert not bad, f"{name}: {bad}"
    assert any("-> fp32" in n for n in notes)


FIRST_LAST = ["parallel.pp=16", "parallel.vpp=null", "parallel.pipeline_layout=null",
              "parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false",
              "parallel.num_layers_in_first_pipeline_stage=3",
              "parallel.num_layers_in_last_pipeline_stage=2"]  # DeepSeek-V3's 61 layers as 3 + 14x4 + 2 over PP16


def test_layers_per_stage_and_chunk_are_kept():
    for full, per_middle in ((True, 4), (False, 2)):  # 3 + 14x4 + 2 layers over PP16; the cap keeps first/last
        _, _, planned, notes, _ = plan_runs("deepseek_v3_pretrain", FIRST_LAST, 8, 6, 4, full_depth=full)
        layout = compose_recipe("deepseek_v3_pretrain", FIRST_LAST + planned["layout"])
        p = layout.parallel
        assert (p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage) == (3, 2)
        assert (layout.model.num_layers - 5) // (p.pp - 2) == per_middle and layout.model.moe_first_dense_layers == 3
        assert any("--full-depth" in n for n in notes) != full
    _, _, planned, _, _ = plan_runs("llama3_70b_pretrain", [], 8, 6, 4, full_depth=True)  # 80 / (PP4 x VPP5) = 4
    l70 = compose_recipe("llama3_70b_pretrain", planned["layout"])
    assert l70.model.num_layers // (l70.parallel.pp * l70.parallel.vpp) == 4


# Megatron-LM's documented DeepSeek-V3 layout: the MTP layer and the loss each on a chunk of their own, PP16 x VPP2
DOCUMENTED = ["parallel.pp=16", "parallel.vpp=2", "parallel.pipeline_layout='Et*3|(tt|)*29,m|L'"]
NO_EP_OVERLAP = ["parallel.overlap_moe_expert_parallel_comm=false", "parallel.delay_wgrad_compute=false"]


def test_pipeline_layout_is_shrunk_with_its_kinds_of_stages():
    """Megatron-LM's DeepSeek-V3 layout "Et*3|(tt|)*29,m|L" on the 8 ranks a check has (PP 16 -> 4, VPP 2 kept):
    the first stage as written, 2 layers per other chunk, the loss in a closing stage of its own; the MTP layer
    joins it there (its own interleaved stage hangs the CPU lane, said in the notes). Without interleaving
    the MTP stage stays apart. deepseek_v3_pretrain's own "Et|(tt|)*30mL" (PP8 x VPP4) keeps its kinds too."""
    from megatron_recipes.config import pipeline_layout

    for full in (True, False):
        cfg, small, planned, notes, _ = plan_runs("deepseek_v3_pretrain", DOCUMENTED, 8, 6, 4, full_depth=full)
        layout = compose_recipe("deepseek_v3_pretrain", planned["layout"])
        p = layout.parallel
        assert (p.pp, p.vpp) == (small.degrees.pp, cfg.parallel.vpp) == (4, 2)
        flat = pipeline_layout.stages(p.pipeline_layout)
        assert flat[0] == "Ettt" and flat[-1] == "mL" and set(flat[1:-1]) == {"tt"}, flat
        assert any("MTP layer shares the loss's stage" in n and "validated, not proven" in n for n in notes)
        assert layout.model.num_layers == "".join(flat).count("t") and layout.model.mtp_num_layers == 1
        reference = compose_recipe("deepseek_v3_pretrain", planned["reference"])
        assert reference.parallel.pipeline_layout is None and reference.model.num_layers == layout.model.num_layers
    plain = [*NO_EP_OVERLAP, "parallel.pp=16", "parallel.vpp=null",
             "parallel.pipeline_layout='Et*3|(tt|)*13,m|L'"]  # 3 + 13x2 layers, MTP, loss: PP16
    _, _, planned, notes, _ = plan_runs("deepseek_v3_pretrain", plain + ["model.num_layers=29"], 8, 6, 4)
    flat = pipeline_layout.stages(compose_recipe("deepseek_v3_pretrain", plain + planned["layout"]).parallel.pipeline_layout)
    assert flat[-2:] == ["m", "L"] and not any("MTP layer shares" in n for n in notes)
    cfg, small, planned, notes, _ = plan_runs("deepseek_v3_pretrain", [], 8, 6, 4)
    p = compose_recipe("deepseek_v3_pretrain", planned["layout"]).parallel
    flat = pipeline_layout.stages(p.pipeline_layout)
    assert (p.pp, p.vpp) == (4, cfg.parallel.vpp) == (4, 4)
    assert flat[0] == "Et" and flat[-1] == "mL" and set(flat[1:-1]) == {"tt"} and len(flat) == 16, flat
    assert not any("MTP layer shares" in n for n in notes)  # it already does, as written


def test_vocabulary_padding_is_kept_and_matched_by_the_reference():
    from megatron_recipes.config import derived

    for vocab, padded in ((128257, True), (128256, False)):  # at TP2: 128256 is a multiple of 128 x 2
        _, small, planned, _, _ = plan_runs("llama3_8b_pretrain", [f"model.vocab_size={vocab}"], 8, 6, 4)
        layout = compose_recipe("llama3_8b_pretrain", planned["layout"])
        reference = compose_recipe("llama3_8b_pretrain", planned["reference"])
        rows = derived.padded_vocab_size(layout.model, layout.parallel.tp)
        assert (rows > layout.model.vocab_size) == padded and layout.model.vocab_size < 2000
        assert derived.padded_vocab_size(reference.model, 1) == rows


def test_context_parallel_is_one_decision():
    tiny = ["parallel.tp=1", "parallel.cp=2"]
    assert context_parallel_unproven(compose_recipe("tiny_llama_cpu", [*tiny, "parallel.cp_comm_type=all_gather"])) is None
    reason = context_parallel_unproven(compose_recipe("tiny_llama_cpu", tiny))  # p2p: Transformer Engine's only
    assert reason and "parallel.cp=2" in reason and "all_gather" in reason
    window = context_parallel_unproven(compose_recipe("tiny_llama_cpu", [*tiny, "parallel.cp_comm_type=all_gather", "model.sliding_window=8"]))
    assert window and "sliding" in window  # the CPU lane's CP attention has no sliding window
    assert context_parallel_unproven(compose_recipe("tiny_llama_cpu", [])) is None


@pytest.mark.parametrize("recipe", ["llama3_8b_pretrain", "deepseek_v3_pretrain"])
def test_context_parallel_layout_runs_all_gather_and_says_so(recipe):
    _, small, planned, notes, _ = plan_runs(recipe, ["parallel.cp=4", "parallel.sp=true"], 8, 6, 4)
    layout = compose_recipe(recipe, planned["layout"])
    p = layout.parallel
    assert p.cp == small.degrees.cp > 1 and p.cp_comm_type == "all_gather" and p.cp_hierarchical_sizes is None
    assert layout.train.seq_length % (2 * p.cp) == 0 and layout.train.seq_length % p.tp == 0
    assert compose_recipe(recipe, planned["reference"]).train.seq_length == layout.train.seq_length
    assert any("cp_comm_type=all_gather" in n and "validated only" in n for n in notes), notes
    if recipe == "deepseek_v3_pretrain":  # MLA's query/key and value head sizes differ: the CPU lane cannot
        assert "multi-latent attention" in context_parallel_unproven(layout)
    else:
        assert context_parallel_unproven(layout) is None


@pytest.mark.parametrize("recipe", ["tiny_llama_lora", "llama3_8b_lora"])
def test_adapter_dropout_is_off_in_both_runs(recipe):
    # Dropout masks are drawn per layout (a TP rank draws its shard's from its own stream): with them on,
    # a correct TP2 layout parts from one rank at step 1 (what check once reported as TRAINS WRONG).
    cfg, _, planned, notes, _ = plan_runs(recipe, [], 8, 6, 4)
    assert cfg.peft.dropout > 0
    for name in ("layout", "reference"):
        assert compose_recipe(recipe, planned[name]).peft.dropout == 0.0, name
    assert any(n.startswith(f"adapter dropout {cfg.peft.dropout:g} -> 0") for n in notes)


@pytest.mark.parametrize("recipe", ["tiny_llama_qlora", "llama3_8b_qlora"])
def test_qlora_double_quantisation_is_off_in_both_runs(recipe):
    # Each TP rank compresses its own shard's block scales: with double quantisation on, a correct TP2
    # layout of tiny_llama_qlora parts from one rank at step 1 by 2.7e-5 (what check reported as TRAINS WRONG).
    cfg, _, planned, notes, _ = plan_runs(recipe, [], 8, 6, 4)
    assert cfg.peft.method == "qlora" and cfg.peft.double_quant
    for name in ("layout", "reference"):
        assert compose_recipe(recipe, planned[name]).peft.double_quant is False, name
    assert any(n.startswith("QLoRA double quantisation -> off") for n in notes)


def test_fsdp_recipe_is_compared_with_the_plain_data_parallel_path_and_reshards_by_weights(tmp_path):
    # Megatron-FSDP checkpoints resume only at their own layout: a full resume on one rank exits 2 (what
    # check once reported as RECIPE ERROR), so the layout's weights are reloaded next to the reference's own.
    _, _, planned, notes, out = plan_runs("tiny_llama_sft_fsdp", [], 8, 6, 4, tmp_path)
    layout, reference = (compose_recipe("tiny_llama_sft_fsdp", planned[n]) for n in ("layout", "reference"))
    assert layout.parallel.fsdp and layout.parallel.sharding == "zero3"
    assert not reference.parallel.fsdp and reference.checkpoint.save and reference.checkpoint.save_interval == 4
    reshard, reweights = (compose_recipe("tiny_llama_sft_fsdp", planned[n]) for n in ("reshard", "reweights"))
    assert reshard.checkpoint.pretrained == str(out / "layout" / "checkpoints")
    assert reweights.checkpoint.pretrained == str(out / "reference" / "checkpoints" / "iter_0000004")
    for cfg in (reshard, reweights):
        assert cfg.checkpoint.load == "none" and not cfg.parallel.fsdp and cfg.train.train_iters == 2
        assert cfg.model == reference.model and cfg.train.global_batch_size == reference.train.global_batch_size
    assert any(n.startswith("reshard by weights") for n in notes)
    _, _, planned, _, _ = plan_runs("tiny_llama_sft", [], 8, 6, 4, tmp_path)
    assert "reweights" not in planned and compose_recipe("tiny_llama_sft", planned["reshard"]).checkpoint.load.endswith("checkpoints")


def test_a_run_shows_its_steps_while_it_goes(tmp_path):
    """check's phases report progress from the steps a run logs (plain lines off a terminal)."""
    import io
    import subprocess
    import sys

    from megatron_recipes.check import runs
    from megatron_recipes.progress import Progress

    run_dir = tmp_path / "layout"
    run_dir.mkdir()
    child = (  # a stand-in run: logs one step record per 0.3 s, as the trainer's log.jsonl has them
        "import json, sys, time\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    for s in (1, 2, 3):\n"
        "        time.sleep(0.3); f.write(json.dumps({'type': 'LOG', 'step': s, 'data': {'loss': 1.0}}) + '\\n'); f.flush()\n"
        "    time.sleep(0.3)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(run_dir / "log.jsonl")])
    stream = io.StringIO()
    with Progress("  layout", total=3, unit="steps", stream=stream, tty=False, interval=0.0, delay=0.0) as bar:
        assert runs.wait_all([proc], [run_dir], 60, bar, poll=0.1) == [0]
    lines = stream.getvalue().splitlines()
    assert any("3 / 3 steps" in line for line in lines) and any(" 1 / 3 steps" in line for line in lines), lines
    assert lines[-1].startswith("  layout: done, 3 steps"), lines
    assert runs.steps_logged(tmp_path / "nothing") == 0


def test_tolerance_grows_with_the_steps_rounding_has_had_to_add_up():
    # 1.5e-5: over one step's rounding at step 1, within five steps' at step 5 (a deep layout's resumed steps)
    early = compare.Series("grad_norm", [1.0 + 1.5e-5, 1.0], [1.0, 1.0])
    late = compare.Series("grad_norm", [1.0, 1.0 + 1.5e-5], [1.0, 1.0], first_step=4)
    v = compare.judge([early], 1e-5)
    assert not v.equal and v.first_diverging_step == 1 and "1 x 1e-05" in v.reason
    assert compare.judge([late], 1e-5).equal
    assert not compare.judge([late], 2e-6).equal


_STAND_IN = (  # a stand-in trainer: `<recipe> [overrides] run.dir=D`; logs its start/end, a step, and exits
    "import json, os, subprocess, sys, time\n"
    "run_dir = sys.argv[-1].split('=', 1)[1]; os.makedirs(run_dir, exist_ok=True)\n"
    "opts = dict(a.split('=', 1) for a in sys.argv[2:-1])\n"
    "open(os.path.join(run_dir, 'start'), 'w').write(repr(time.time()))\n"
    "if 'child' in opts:  # a rank of its own, which must die with it\n"
    "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "    open(os.path.join(run_dir, 'child'), 'w').write(str(child.pid))\n"
    "print('hello from', os.path.basename(run_dir), flush=True)\n"
    "while not os.path.exists(opts['wait_for']):\n"
    "    time.sleep(0.05)\n"
    "with open(os.path.join(run_dir, 'log.jsonl'), 'a') as f:\n"
    "    f.write(json.dumps({'type': 'LOG', 'step': 1, 'data': {'loss': 1.0}}) + '\\n')\n"
    "open(os.path.join(run_dir, 'end'), 'w').write(repr(time.time()))\n"
    "sys.exit(int(opts.get('code', 0)))\n"
)


def _stand_in(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    return (str(script),)  # what each rank's ``python`` runs, as ``("-m", "megatron_recipes.train")`` by default


def test_independent_runs_go_side_by_side_and_report_in_order(tmp_path):
    """Each run waits until the other has started: run one at a time, this would time out."""
    from megatron_recipes.check import runs

    a, b = tmp_path / "reference", tmp_path / "layout"
    jobs = [runs.Job("reference", [f"wait_for={b / 'start'}"], a, 1),
            runs.Job("layout", [f"wait_for={a / 'start'}", "code=3"], b, 1, ranks=2)]
    results = runs.train_together(jobs, "tiny", 120, progress=False, entry=_stand_in(tmp_path))
    assert [(r.name, r.returncode, r.run_dir) for r in results] == [("reference", 0, a), ("layout", 3, b)]
    assert results[0].output.startswith("$ ") and "hello from reference" in results[0].output
    assert "hello from layout" in results[1].output and results[1].series("loss") == {1: 1.0}


def test_a_timeout_stops_every_run_still_going_with_its_ranks(tmp_path):
    from megatron_recipes.check import runs

    done, stuck = tmp_path / "reshard", tmp_path / "reweights"
    jobs = [runs.Job("reshard", [f"wait_for={tmp_path}"], done, 1),  # ends at once
            runs.Job("reweights", [f"wait_for={tmp_path / 'never'}", "child=1"], stuck, 1)]
    results = runs.train_together(jobs, "tiny", 8, progress=False, entry=_stand_in(tmp_path))
    assert [r.returncode for r in results] == [0, 124]
    assert "[check] stopped after" in results[1].output and "[check] stopped" not in results[0].output
    stat = Path(f"/proc/{(stuck / 'child').read_text()}/stat")  # its own rank was killed with it
    for _ in range(100):
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the run's rank outlived it")


_RANK_STAND_IN = (  # one rank: `<recipe> [opts] run.dir=D`; says what a launcher gave it, then fails or waits
    "import json, os, subprocess, sys, time\n"
    "run_dir = sys.argv[-1].split('=', 1)[1]; os.makedirs(run_dir, exist_ok=True)\n"
    "opts = dict(a.split('=', 1) for a in sys.argv[2:-1])\n"
    "rank = os.environ.get('RANK', '-')\n"
    "info = {k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}\n"
    "info.update(pid=os.getpid(), pgid=os.getpgid(0), argv=sys.argv[1:])\n"
    "if 'child' in opts:  # a process of its own (as a checkpoint writer would be), which must die with it\n"
    "    info['child'] = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']).pid\n"
    "open(os.path.join(run_dir, f'rank{rank}.json'), 'w').write(json.dumps(info))\n"
    "print('hello from rank', rank, flush=True)\n"
    "if opts.get('fail_rank') == rank:\n"
    "    sys.exit(2)\n"
    "time.sleep(120)\n"
)


def _gone(pid: int) -> bool:
    """``pid`` has exited (or is a zombie waiting for its new parent), within ~10 s."""
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(100):
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.1)
    return False


def _rank_infos(run_dir: Path, world: int) -> list:
    import json

    for _ in range(3000):  # up to 5 min: the ranks' server imports torch and megatron-core first (slow when loaded)
        paths = [run_dir / f"rank{r}.json" for r in range(world)]
        if all(p.is_file() and p.stat().st_size for p in paths):
            return [json.loads(p.read_text()) for p in paths]
        time.sleep(0.1)
    raise AssertionError(f"the ranks of {run_dir} did not start")


def test_a_run_starts_its_ranks_as_a_launcher_would_and_a_failing_rank_stops_the_others(tmp_path):
    from megatron_recipes.check import runs

    script = tmp_path / "rank.py"
    script.write_text(_RANK_STAND_IN)
    run_dir = tmp_path / "layout"
    results = runs.train_together([runs.Job("layout", ["fail_rank=1"], run_dir, 1, ranks=2)], "tiny", 120,
                                  progress=False, entry=(str(script),))
    assert results[0].returncode == 2  # rank 1's code, not the timeout's 124: rank 0 (waiting 120 s) was stopped
    infos = _rank_infos(run_dir, 2)
    assert [(i["RANK"], i["LOCAL_RANK"], i["WORLD_SIZE"]) for i in infos] == [("0", "0", "2"), ("1", "1", "2")]
    assert infos[0]["MASTER_PORT"] == infos[1]["MASTER_PORT"] and infos[0]["MASTER_ADDR"] == "127.0.0.1"
    assert all(i["pgid"] == i["pid"] for i in infos)  # each rank leads its own process group
    assert infos[0]["argv"] == ["tiny", "fail_rank=1", f"run.dir={run_dir}"]
    assert _gone(infos[0]["pid"])
    assert "hello from rank 0" in results[0].output and "hello from rank 1" in results[0].output


def test_ctrl_c_stops_every_rank_and_what_the_ranks_started(tmp_path):
    import json
    import signal
    import subprocess

    script = tmp_path / "rank.py"
    script.write_text(_RANK_STAND_IN)
    run_dir = tmp_path / "layout"
    # SIGINT as at a terminal: a runner started in the background (``cmd &``) hands its children SIGINT ignored
    driver = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from pathlib import Path; from megatron_recipes.check import runs\n"
              "jobs = [runs.Job('layout', ['child=1'], Path(sys.argv[1]), 1, ranks=2)]\n"
              "print([r.returncode for r in runs.train_together(jobs, 'tiny', 300, progress=False, entry=(sys.argv[2],))])\n")
    proc = subprocess.Popen([sys.executable, "-c", driver, str(run_dir), str(script)], stdout=subprocess.PIPE, text=True)
    try:
        infos = _rank_infos(run_dir, 2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)  # a loaded machine: the ranks' server may still be importing
    finally:
        proc.kill()
    assert json.loads(out.strip()) == [124], out
    for info in infos:
        assert _gone(info["pid"]) and _gone(info["child"]), info
    assert "[check] stopped after" in (tmp_path / "layout.log").read_text()


def test_fine_tuning_on_mock_tokens_runs_short_sequences_and_offloading_is_off():
    """A fine-tuning recipe whose chat file is not here trains on mock tokens: any length is a sample, so
    the layout runs the short sequences pretraining recipes do; its own built-in chat data keeps the recipe's
    length (samples must fit whole). Host-memory offloading is switched off, said."""
    _, _, planned, notes, _ = plan_runs("llama3_70b_sft_fsdp", [], 8, 6, 4)
    layout = compose_recipe("llama3_70b_sft_fsdp", planned["layout"])
    assert layout.data.kind == "mock" and layout.train.seq_length == seq_length(
        Degrees(layout.parallel.tp, 1, 1, 1, None, 1), layout.parallel.sp)
    assert not layout.optimizer.cpu_offload and any("optimizer.cpu_offload -> false" in n for n in notes), notes
    _, _, planned, _, _ = plan_runs("tiny_llama_sft", [], 8, 6, 4)
    own = compose_recipe("tiny_llama_sft", planned["layout"])
    assert own.data.kind == "sft" and own.train.seq_length == compose_recipe("tiny_llama_sft", []).train.seq_length



# --- what the check may delete, and when its verdict means something (issue 30, cases 1 and 11) -----
class _NothingTrains(Exception):
    """Raised where the check would start its first run: the tests below stop there."""


@pytest.fixture
def no_runs(monkeypatch):
    """The check up to its first run, without the ranks' server or any training."""
    from megatron_recipes.check import cli, runs
    from megatron_recipes.runtime import ranks

    monkeypatch.setattr(ranks, "context", lambda **_: None)
    monkeypatch.setattr(ranks, "stop", lambda: None)

    def train_together(*_a, **_k):
        raise _NothingTrains()

    monkeypatch.setattr(runs, "train_together", train_together)
    return cli


def test_check_never_deletes_a_folder_it_did_not_write(no_runs, tmp_path):
    # Before: `check tiny_llama_cpu --dir <existing folder>` removed the folder and everything in it.
    from megatron_recipes.config.errors import RecipeError

    mine = tmp_path / "my-run"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(RecipeError, match="--dir.*not a check output") as err:
        no_runs.main(["tiny_llama_cpu", "--dir", str(mine)])
    assert "remove this one yourself" in err.value.fix
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "checkpoints").is_dir()


def test_check_refuses_a_run_name_that_climbs_out_of_runs(no_runs, tmp_path, monkeypatch):
    # Before: `check ... run.name=..` made the output runs/check/.., i.e. ./runs, and deleted it whole.
    from megatron_recipes.config.errors import RecipeError

    monkeypatch.chdir(tmp_path)
    other = tmp_path / "runs" / "pretrain" / "checkpoints"
    other.mkdir(parents=True)
    with pytest.raises(RecipeError, match=r"run\.name.*'\.\.'"):
        no_runs.main(["tiny_llama_cpu", "run.name=.."])
    assert other.is_dir()


def test_check_replaces_its_own_previous_output_and_marks_the_new_one(no_runs, tmp_path):
    from megatron_recipes import files

    out = tmp_path / "check"
    first = files.fresh_own_dir(out, no_runs.OUTPUT, "--dir")
    (first / "layout.log").write_text("an old run")
    with pytest.raises(_NothingTrains):  # the check went on to its runs
        no_runs.main(["tiny_llama_cpu", "--dir", str(out)])
    assert not (out / "layout.log").exists() and files.own_kind(out) == "check"


@pytest.mark.parametrize("flag, value", [("--max-ranks", "0"), ("--max-ranks", "1"), ("--rtol", "nan"), ("--rtol", "0"),
                                         ("--rtol", "-1e-5"), ("--rtol", "inf"), ("--rtol", "2")])
def test_check_refuses_flags_that_would_prove_nothing(no_runs, tmp_path, capsys, flag, value):
    # Before: --max-ranks 0 compared one rank with one rank and printed PROVEN; --rtol took any number.
    from megatron_recipes import cli as top

    code = top.main(["check", "tiny_llama_cpu", f"{flag}={value}", "--dir", str(tmp_path / "check")])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} {float(value) if flag == '--rtol' else value}" in err and "fix: use" in err, err
    assert not (tmp_path / "check").exists()


def test_check_refuses_a_layout_that_is_the_one_rank_reference(no_runs, tmp_path):
    # Before: a one-rank layout was "proven" against the one-rank reference.
    from megatron_recipes.cli_args import split_args
    from megatron_recipes.config.errors import RecipeError

    args = split_args(["tiny_llama_cpu", "parallel.tp=1", "cluster.gpus_per_node=1", "--dir", str(tmp_path / "c")],
                      no_runs.PROG, no_runs.FLAGS)
    with pytest.raises(RecipeError, match="same as the one-rank reference"):
        no_runs._check(args, no_runs._compose(args.recipe, args.overrides))
    assert not (tmp_path / "c").exists()
