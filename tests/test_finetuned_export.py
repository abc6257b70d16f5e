"""A fine-tuned run leaves as something transformers runs the way the run ran: its tokenizer (the built-in
one too) with the chat template it trained with, a ``generation_config.json`` that stops where its answers
stop, and, as an adapter, the LM head it trained whole in HF PEFT's ``modules_to_save`` form.

The run is README's order in miniature (finetuned_support). transformers' greedy ``generate`` on the
merged export must produce the tokens ``megatron-recipes generate`` produces from the checkpoint.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cli_support import run_cli
from finetuned_support import convert, hf_answers, merged_export, readme_lora

pytestmark = pytest.mark.slow

QUESTIONS = ["What type is [3, 'node']?", "What type is 2.5?", "Which Python type is {'a': 1}?"]


@pytest.fixture(scope="module")
def exports(shared_runs, tmp_path_factory):
    run = readme_lora(shared_runs)
    out = tmp_path_factory.mktemp("finetuned-exports")
    lora = run.lora.run_dir
    done = {
        "adapter": convert(run, "export", f"ckpt_dir={lora}", f"hf_dir={out / 'adapter'}", "adapter_only=true", "--verify"),
        "base": convert(run, "export", f"ckpt_dir={run.base.run_dir}", f"hf_dir={out / 'base'}", "--quiet", "--no-verify"),
    }
    for name, result in done.items():
        assert result == {"code": 0, "error": None}, (name, result)
    (out / "merged").symlink_to(merged_export(shared_runs), target_is_directory=True)
    return run, out


def test_adapter_export_carries_the_head_trained_whole(exports):
    """modules_to_save=[output_layer] -> HF PEFT's modules_to_save=["lm_head"], weight under its own name;
    the CLI's own --verify compared HF base + adapter with the trained model (float32, 1e-4)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, out = exports
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["lm_head"]
    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    head = tensors["base_model.model.lm_head.weight"]
    assert tuple(head.shape) == (640, 128)

    def hf(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    base = hf(out / "base")
    assert not torch.equal(base.lm_head.weight, head)  # the head trained: the check can fail
    tokens = torch.randint(0, 600, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(tokens).logits
        merged = hf(out / "merged")(tokens).logits
    assert float((adapted - merged).abs().max()) <= 1e-4  # two exports of one run, two independent paths


def test_exports_carry_the_runs_tokenizer_chat_template_and_stops(exports):
    from megatron_recipes.data.sft.templates import template_text

    from transformers import AutoTokenizer

    run, out = exports
    tokenizer = AutoTokenizer.from_pretrained(str(out / "merged"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # the built-in tokenizer's end of turn: one token
    for kind in ("merged", "adapter"):
        folder = out / kind
        assert (folder / "tokenizer.json").is_file(), kind
        generation = json.loads((folder / "generation_config.json").read_text())
        # answers end by id alone: no stop_strings, which transformers' generate refuses without a tokenizer
        assert generation["eos_token_id"] == sorted({0, end}) and "stop_strings" not in generation, generation
    assert tokenizer.chat_template == template_text("chatml")
    base_generation = json.loads((out / "base" / "generation_config.json").read_text())
    assert "stop_strings" not in base_generation and base_generation["eos_token_id"] == 0  # pretraining: no chat


def test_transformers_on_the_merged_export_answers_as_generate_does(exports):
    from transformers import AutoTokenizer

    run, out = exports
    done = run_cli(["generate", str(run.lora.run_dir), *QUESTIONS, "max_new_tokens=32", "--json"], timeout=600,
                   cwd=str(run.root))
    assert done.returncode == 0, done.stderr[-3000:]
    ours = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    theirs = hf_answers(out / "merged", QUESTIONS)
    tokenizer = AutoTokenizer.from_pretrained(str(out / "merged"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for record, ids in zip(ours, theirs):
        assert ids[: len(record["tokens"])] == record["tokens"], (record, ids)
        assert ids[len(record["tokens"]):] == [end] or len(ids) == 32, (ids, record)  # both stopped at the end of turn
        assert tokenizer.decode(ids, skip_special_tokens=True) == record["text"]


def test_tokenizer_only_assets_are_taken_and_another_tokenizer_is_refused(exports, tmp_path):
    from tokenizers import Tokenizer

    run, out = exports
    own = tmp_path / "own-tokenizer"
    own.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(out / "merged" / name, own / name)
    taken = convert(run, "export", f"ckpt_dir={run.lora.run_dir}", f"hf_dir={tmp_path / 'with-own'}", f"hf_assets={own}",
                    "--quiet", "--no-verify")
    assert taken == {"code": 0, "error": None}, taken
    assert json.loads((tmp_path / "with-own" / "config.json").read_text())["vocab_size"] == 640

    other = tmp_path / "other-tokenizer"
    shutil.copytree(own, other)
    backend = Tokenizer.from_file(str(other / "tokenizer.json"))
    backend.add_tokens(["<other>"])
    backend.save(str(other / "tokenizer.json"))
    refused = convert(run, "export", f"ckpt_dir={run.lora.run_dir}", f"hf_dir={tmp_path / 'with-other'}", f"hf_assets={other}",
                      "--quiet", "--no-verify")
    assert refused["code"] == 2 and "is not the one" in refused["error"] and "content hash" in refused["error"], refused
    assert not (tmp_path / "with-other").exists()
