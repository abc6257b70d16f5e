"""PEFT settings: recipes compose, bad input fails before training with the field, the rule and a fix."""

from __future__ import annotations

import pytest

import peft_support as ps
from megatron_recipes.config.compose import compose_recipe
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.validation.rules_peft import PEFT_RULES
from megatron_recipes.validation.validate import validate

FINE_TUNING = [
    "tiny_llama_sft",
    "tiny_llama_lora",
    "tiny_llama_qlora",
    "tiny_llama_ptuning",
    "llama3_8b_lora",
    "llama3_8b_qlora",
    "llama3_70b_lora",
    "llama3_70b_sft",
    "qwen25_7b_lora",
]
INPUTS = ["checkpoint.pretrained=/ckpt/base", "data.sft_path=/data/train.jsonl", "data.tokenizer=/hf/model"]


@pytest.mark.parametrize("recipe", FINE_TUNING)
def test_fine_tuning_recipes_compose_and_pass_every_rule(recipe):
    cfg = compose_recipe(recipe, INPUTS)
    assert validate(cfg) == [], [v.render() for v in validate(cfg)]
    assert cfg.data.kind == "sft" and cfg.checkpoint.pretrained == "/ckpt/base"


@pytest.mark.parametrize("recipe", FINE_TUNING)
def test_fine_tuning_recipes_require_a_pretrained_base(recipe):
    found = {v.rule_id: v.message for v in validate(compose_recipe(recipe, INPUTS[1:] + ["checkpoint.pretrained=null"]))}
    assert "random weights" in found.get("peft.needs_pretrained", ""), found


def test_recipes_without_the_group_keep_full_training_and_can_add_it():
    assert compose_recipe("tiny_llama_cpu").peft.method == "none"
    added = compose_recipe("tiny_llama_cpu", ["+peft=qlora"])
    assert added.peft.method == "qlora" and added.peft.nf4_block_size == 64
    assert compose_recipe("tiny_llama_cpu", ["peft.method=dora", "peft.rank=4"]).peft.rank == 4
    assert compose_recipe("tiny_llama_lora", INPUTS + ["peft=dora"]).peft.method == "dora"


def _peft_violations(*overrides):
    cfg = compose_recipe("tiny_llama_lora", INPUTS + list(overrides))
    return {v.rule_id: v.message for v in validate(cfg, rules=PEFT_RULES)}


@pytest.mark.parametrize(
    "overrides, rule, words",
    [
        (["peft.target_modules=[linear_qkv,q_proj]"], "peft.lora_values", ["q_proj", "linear_qkv", "linear_fc2", "expert_fc1"]),
        (["peft.target_modules=[expert_fc1]"], "peft.lora_values", ["expert_fc1", "does not have"]),
        (["peft.rank=200"], "peft.rank_fits", ["peft.rank=200", "linear_qkv", "128 -> 256", "<= 128"]),
        (["peft.method=qlora", "peft.nf4_block_size=48"], "peft.nf4_blocks", ["nf4_block_size=48", "128 input features", "64"]),
        (["peft.method=qlora", "peft.nf4_block_size=128"], "peft.nf4_blocks", ["64 input features per rank", "linear_proj"]),
        (["peft.method=ptuning", "peft.prefix_length=400"], "peft.prefix_room", ["128 + peft.prefix_length=400", "512"]),
        (["peft.method=lora+ptuning"], "peft.method", ["cannot combine", "qlora+dora"]),
        (["peft.method=lora+qlora"], "peft.method", ["cannot combine"]),
        (["peft.method=adapter"], "peft.method", ["unknown", "adapter"]),
        (["peft.rank=0"], "peft.lora_values", ["rank=0"]),
        (["peft.dropout=1.5"], "peft.lora_values", ["dropout=1.5"]),
    ],
)
def test_bad_peft_settings_are_named(overrides, rule, words):
    found = _peft_violations(*overrides)
    assert rule in found, found
    for word in words:
        assert word in found[rule], (word, found[rule])


def test_good_combinations_pass():
    assert _peft_violations("peft.method=qlora+dora") == {}
    assert _peft_violations("peft.method=ptuning", "peft.prefix_length=16") == {}


def test_missing_pretrained_is_a_rule_violation():
    cfg = compose_recipe("tiny_llama_cpu", ["peft.method=lora"])
    found = {v.rule_id: v for v in validate(cfg, rules=PEFT_RULES)}
    assert "peft.needs_pretrained" in found and "random weights" in found["peft.needs_pretrained"].message


# --- against a built model (one gloo rank in a child process) ---


def _errors_job():
    from megatron_recipes.models.builder import build_model_chunks
    from megatron_recipes.peft import apply_peft
    from megatron_recipes import checkpoint
    from megatron_recipes.checkpoint._adapters import model_state as checkpoint_state
    from megatron_recipes.runtime.distributed import init_model_parallel

    out = {}

    def attempt(label, fn):
        try:
            fn()
            out[label] = None
        except RecipeError as exc:
            out[label] = exc.render()

    cfg = ps.tiny_cfg(1, "peft.method=lora", "peft.target_modules=[linear_qkv,nonsense]")
    init_model_parallel(cfg)
    attempt("unknown", lambda: apply_peft(build_model_chunks(cfg), cfg, report=False))
    cfg = ps.tiny_cfg(1, "peft.method=lora", "peft.rank=300")
    attempt("rank", lambda: apply_peft(build_model_chunks(cfg), cfg, report=False))
    cfg = ps.tiny_cfg(1, "peft.method=qlora", "peft.nf4_block_size=96")
    attempt("blocks", lambda: apply_peft(build_model_chunks(cfg), cfg, report=False))

    cfg = ps.tiny_cfg(1, "peft.method=qlora")
    chunks = build_model_chunks(cfg)
    summary = apply_peft(chunks, cfg, report=False)
    out["summary"] = (summary.trainable, summary.total, summary.base_bytes_bf16, summary.base_bytes_stored, summary.lines())
    attempt("twice", lambda: apply_peft(chunks, cfg, report=False))
    state = checkpoint_state(chunks[0], {})
    out["state_keys"] = sorted(state)
    out["trainable_names"] = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)

    cfg = ps.tiny_cfg(1, "peft.method=lora", "peft.modules_to_save=[output_layer]")
    chunks = build_model_chunks(cfg)
    summary = apply_peft(chunks, cfg, report=False)
    out["saved_head"] = {
        "trainable": summary.trainable,
        "head": chunks[0].output_layer.weight.numel(),
        "state_keys": sorted(checkpoint_state(chunks[0], {})),
        "trainable_names": sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad),
    }

    cfg = ps.tiny_cfg(1, "peft.method=lora", "checkpoint.pretrained=/nonexistent/base")
    attempt("pretrained", lambda: checkpoint.start_of(cfg, adapters_only=True).load_weights(build_model_chunks(cfg)))
    return out


@pytest.fixture(scope="module")
def built():
    return ps.run_ranks(1, _errors_job)[0]


def test_runtime_errors_name_the_problem(built):
    assert "nonsense" in built["unknown"] and "linear_fc1" in built["unknown"]
    assert "peft.rank=300" in built["rank"]
    assert "nf4_block_size=96" in built["blocks"]
    assert "twice" in built["twice"]
    assert "does not exist" in built["pretrained"], built["pretrained"]


def test_qlora_summary_reports_counts_and_memory(built):
    trainable, total, bf16, stored, lines = built["summary"]
    # tiny_llama: 4 layers x rank 16 x (qkv 128+256, proj 128+128, fc1 128+768, fc2 384+128) = 131072
    assert trainable == 4 * 16 * ((128 + 256) + (128 + 128) + (128 + 768) + (384 + 128))
    assert bf16 == 2 * 4 * (128 * 256 + 128 * 128 + 128 * 768 + 384 * 128)
    assert bf16 / stored >= 3.5
    assert lines[0].startswith(f"trainable params: {trainable:,} || all params: {total:,} || trainable%:")
    assert "NF4" in lines[1]


def test_adapter_only_checkpoint_state(built):
    assert built["state_keys"] == built["trainable_names"]  # exactly the trainable tensors, base keys untouched
    assert all(k.endswith(("lora_a", "lora_b")) for k in built["state_keys"])


def test_modules_to_save_trains_the_head_and_saves_it_with_the_adapters(built):
    """peft.modules_to_save=[output_layer]: the LM head trains whole beside the adapters (HF PEFT's
    modules_to_save) and the adapter-only checkpoint carries it; the rest of the base stays frozen."""
    head = built["saved_head"]
    lora = 4 * 16 * ((128 + 256) + (128 + 128) + (128 + 768) + (384 + 128))
    assert head["trainable"] == lora + head["head"]
    assert "output_layer.weight" in head["trainable_names"]
    assert head["state_keys"] == head["trainable_names"]
    assert [k for k in head["state_keys"] if not k.endswith(("lora_a", "lora_b"))] == ["output_layer.weight"]
