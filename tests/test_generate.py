"""``megatron-recipes generate`` against transformers' ``generate`` on the exported HF model, token for token.

A tiny random HF model (tests/convert_support.py) with the small built-in tokenizer is imported, exported
again (the HF model a user would run), and generated from through the real command (its own torchrun
ranks, gloo on the CPU lane) at several layouts: greedy, 64 new tokens, prompts of different lengths in
one batch. Both sides run in float32; the reference stops at the same end tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List

import pytest

from cli_support import run_cli
from convert_support import make_hf_model
from data_support import small_builtin, write_jsonl

PROMPTS = ["def main():", "import os\nimport sys\n\nclass Parser:\n    def __init__(self, path):", "x ="]
NEW_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _hf_with_tokenizer(folder: Path, family: str, tokenizer_dir: Path) -> Path:
    make_hf_model(family, folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, folder / name)
    return folder


def _models(shared_runs, data_cache, family: str) -> Dict[str, Path]:
    """Imported checkpoint (``ckpt``) and its export (``hf``) of one tiny ``family`` model with a real tokenizer."""

    def make():
        from megatron_recipes.config.schema import ParallelConfig
        from megatron_recipes.convert.exporter import run_export
        from megatron_recipes.convert.importer import run_import

        root = shared_runs.folder(f"generate-{family}")
        source = _hf_with_tokenizer(root / "source", family, Path(small_builtin(data_cache).tokenizer_dir))
        run_import(source, root / "ckpt", ParallelConfig(), dtype="fp32", progress=False)
        run_export(root / "ckpt", root / "hf", progress=False)
        return {"ckpt": root / "ckpt", "hf": root / "hf"}

    return shared_runs.get(("generate", family), make)


def generate_cli(ckpt: Path, *args: str, timeout: float = 900) -> List[dict]:
    """The command as a user runs it (its own process, forked: tests/cli_support.py); its --json records."""
    done = run_cli(["generate", str(ckpt), *args, "--json"], timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def hf_greedy(hf_dir: Path, prompts: List[str], new_tokens: int) -> List[List[int]]:
    """transformers' greedy generate, one prompt at a time, cut before its first end token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    configured = model.generation_config.eos_token_id  # one id or a list (the export writes the run's stops)
    stops = sorted(({tokenizer.eos_token_id} | set(configured if isinstance(configured, list) else [configured])) - {None})
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        generated = full[0, ids.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(generated) if t in stops), len(generated))
        out.append(generated[:cut])
    return out


CASES = [  # (family, layout): each family at the layouts its mapping has to get right
    ("llama", ["parallel.tp=1"]),
    ("llama", ["parallel.tp=2"]),
    ("llama", ["parallel.pp=2"]),
    ("qwen2", ["parallel.tp=2"]),  # tied embeddings: the output layer reads the embedding's shard
    ("mixtral", ["parallel.ep=2"]),
]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{'-'.join(a.split('.')[-1].replace('=', '') for a in l)}" for f, l in CASES])
def test_greedy_generate_is_token_identical_to_transformers(shared_runs, data_cache, family, layout, tmp_path):
    models = _models(shared_runs, data_cache, family)
    reference = shared_runs.get(("generate-reference", family), lambda: hf_greedy(models["hf"], PROMPTS, NEW_TOKENS))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    records = generate_cli(models["ckpt"], f"prompts={prompts}", f"max_new_tokens={NEW_TOKENS}", *layout)
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["tokens"] for r in records] == reference
    assert all(len(r["tokens"]) == NEW_TOKENS or r["finish_reason"] == "stop" for r in records)
    assert sum(len(r["tokens"]) for r in records) > NEW_TOKENS  # not a trivial agreement on empty answers


# --- options, prompts and answers: checked before any rank starts ---


def _parse(*overrides: str):
    from megatron_recipes.generate.options import parse

    return parse(list(overrides), "generate")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["temperature=-1"], "temperature=-1.0 is negative"),
        (["temperature=0.8", "top_k=5", "top_p=0.9"], "both set"),
        (["top_p=1.5", "temperature=1"], "outside [0, 1]"),
        (["top_k=5"], "temperature=0 is greedy"),
        (["max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
        (["max_tokens=3"], "unknown option 'max_tokens'"),
        (["parallel.tp=two"], "parallel.tp=two is not an integer"),
    ],
)
def test_bad_options_are_refused_with_the_field_named(overrides, message):
    from megatron_recipes.config.errors import RecipeError

    with pytest.raises(RecipeError) as raised:
        _parse(*overrides)
    assert message in raised.value.message


def test_sampling_options_are_typed():
    opts = _parse("temperature=0.7", "top_p=0.9", "seed=3", "parallel.tp=2", "stop=###", "chat=false")
    assert (opts.temperature, opts.top_p, opts.seed, opts.parallel.given(), opts.stop, opts.chat) == (0.7, 0.9, 3, {"tp": 2}, "###", False)


def test_prompts_file_errors_name_the_line(tmp_path):
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.generate.options import read_prompts

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"text": "b = 1"}\n')
    assert read_prompts(str(good)) == ["a", "b = 1"]
    for body, message in [('{"prompt": "a"}\nnot json\n', "line 2: not JSON"), ('{"question": "a"}\n', 'line 1: no non-empty "prompt"')]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(RecipeError) as raised:
            read_prompts(str(bad))
        assert message in raised.value.message


def test_command_line_keeps_prompts_with_equals_signs_and_refuses_unknown_flags():
    from megatron_recipes.config.errors import RecipeError
    from megatron_recipes.generate.cli import split

    positional, overrides, flags = split(["runs/x", "What is x = 3?", "top_k=0", "--json", "a==b"])
    assert (positional, overrides, flags) == (["runs/x", "What is x = 3?", "a==b"], ["top_k=0"], {"json"})
    with pytest.raises(RecipeError, match="unknown flag '--stream'"):
        split(["runs/x", "--stream"])


def test_cli_errors_are_one_message_without_traceback(tmp_path):
    done = run_cli(["generate", str(tmp_path / "missing"), "hello"], timeout=300)
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def chat_maker(data_cache):
    """The prompt side of a fine-tuned (SFT) run on the built-in tokenizer with its chatml template."""
    from data_support import small_cfg
    from megatron_recipes.data.tokenizer import load_tokenizer_dir
    from megatron_recipes.data.prompts import PromptMaker, wants_chat

    cfg = small_cfg(data_cache, "data.kind=sft", "data.sft_path=builtin", "data.chat_template=chatml")
    tokenizer = load_tokenizer_dir(small_builtin(data_cache).tokenizer_dir)
    assert wants_chat(cfg, None) and not wants_chat(cfg, False)
    return PromptMaker(tokenizer, cfg, chat=True), cfg, tokenizer


def _tokenizer_without_turn_tokens(folder):
    """A byte-level BPE whose chatml turn markers are plain text (several tokens each), as some users' are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_recipes.data.builtin import EOD_TOKEN, PAD_TOKEN
    from megatron_recipes.data.sft.templates import template_text
    from megatron_recipes.data.tokenizer import load_tokenizer_dir

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOD_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["What type is [3, 'node']? list", "user assistant"] * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD_TOKEN, pad_token=PAD_TOKEN)
    hf.chat_template = template_text("chatml")
    hf.save_pretrained(str(folder))
    return load_tokenizer_dir(folder)


def test_chat_prompt_is_tokenized_as_fine_tuning_rendered_it(chat_maker, tmp_path):
    """The ids fed to the model are the fine-tuning sample's ids up to where its answer starts, and the
    answer ends where the sample's did: at the template's end-of-turn, which a tokenizer without an
    ``<|im_end|>`` token spells in several tokens, so it is a stop text, not the engine's one stop id."""
    from megatron_recipes.data.prompts import PromptMaker
    from megatron_recipes.data.sft.render import ChatRenderer
    from megatron_recipes.data.sft.templates import template_text

    _, cfg, _ = chat_maker
    tokenizer = _tokenizer_without_turn_tokens(tmp_path)
    maker = PromptMaker(tokenizer, cfg, chat=True)
    question = "What type is [3, 'node']?"
    sample = ChatRenderer(tokenizer.hf, template_text("chatml")).tokenize(
        [("t", [{"role": "user", "content": question}, {"role": "assistant", "content": "list"}])]
    )[0]
    answer_start = int(sample.mask.argmax())
    prompt = maker.encode(question)
    assert prompt.ids == sample.ids[:answer_start].tolist()
    taught = sample.ids[answer_start:].tolist()  # "list<|im_end|>\n", token by token, as fine-tuning taught it
    word = tokenizer.hf("list", add_special_tokens=False)["input_ids"]
    assert tokenizer.hf.convert_tokens_to_ids("<|im_end|>") is None and taught[: len(word)] == word
    assert maker.termination_id == tokenizer.eod and maker.stop_texts == ["<|im_end|>"]
    first_end = next(n for n in range(len(taught) + 1) if maker.ended(taught[:n]))
    assert tokenizer.hf.decode(taught[:first_end]).endswith("<|im_end|>") and not maker.ended(taught[: first_end - 1])
    got = maker.answer(prompt, taught + taught, 64)  # the model ran on past the turn's end
    assert (got.text, got.tokens, got.finish_reason) == ("list", word, "stop")


def test_builtin_tokenizers_end_of_turn_is_one_special_token_the_engines_stop_id(chat_maker):
    """The built-in tokenizer has chatml's turn markers as special tokens: a fine-tuned answer ends at one
    id (what an export's generation_config can name), and the fine-tuning sample ends with it too."""
    from megatron_recipes.data.sft.render import ChatRenderer
    from megatron_recipes.data.sft.templates import template_text

    maker, _, tokenizer = chat_maker
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(end, int) and maker.termination_id == end and {end, tokenizer.eod} <= maker.stop_ids
    assert maker.stop_texts == [] and maker.ended([5, end]) and not maker.ended([5, 6])
    sample = ChatRenderer(tokenizer.hf, template_text("chatml")).tokenize(
        [("t", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "list"}])]
    )[0]
    taught = sample.ids[int(sample.mask.argmax()):].tolist()
    word = tokenizer.hf("list", add_special_tokens=False)["input_ids"]
    assert taught[: len(word) + 1] == word + [end]  # fine-tuning taught the one id after the answer


def test_answers_end_at_stop_tokens_and_stop_text(chat_maker):
    from megatron_recipes.data.prompts import PromptMaker

    maker, cfg, tokenizer = chat_maker
    prompt = maker.encode("hi")
    words = tokenizer.hf("list of words", add_special_tokens=False)["input_ids"]
    ended = maker.answer(prompt, words + [tokenizer.eod] + words, 64)
    assert (ended.tokens, ended.text, ended.finish_reason) == (words, "list of words", "stop")
    full = maker.answer(prompt, words, len(words))
    assert full.finish_reason == "length"
    stopping = PromptMaker(tokenizer, cfg, chat=True, stop=" of")
    cut = stopping.answer(prompt, words, len(words))
    assert cut.text == "list" and cut.finish_reason == "stop" and tokenizer.hf.decode(cut.tokens) == "list"
    first = next(n for n in range(1, len(words) + 1) if stopping.ended(words[:n]))  # asked after each token
    assert " of" in tokenizer.hf.decode(words[:first]) and " of" not in tokenizer.hf.decode(words[: first - 1])


def test_engine_stops_the_rows_whose_answer_ended():
    """The controller's extra end check: only started, unfinished rows, on their own generated ids."""
    import torch

    from megatron_recipes.generate.engine import finished_rows

    tokens = torch.tensor([[1, 2, 7, 8, 9], [1, 7, 8, 3, 3], [7, 8, 7, 8, 7], [1, 2, 3, 7, 8]])
    started = torch.tensor([True, True, False, True])
    done = torch.tensor([False, False, False, True])
    lengths = torch.tensor([3, 4, 0, 2])  # ids generated so far, the newest at position 4
    seen = []

    def ended(ids):
        seen.append(ids)
        return ids[-1] == 9

    assert finished_rows(tokens, 4, started, done, lengths, ended).tolist() == [True, False, False, True]
    assert seen == [[7, 8, 9], [7, 8, 3, 3]]
    assert done.tolist() == [False, False, False, True]  # the caller's tensor is left alone


def test_generation_stops_at_a_stop_text(shared_runs, data_cache):
    """Through the real command: the answer is the reference's text up to the stop text, finished by it."""
    from transformers import AutoTokenizer

    models = _models(shared_runs, data_cache, "llama")
    reference = shared_runs.get(("generate-reference", "llama"), lambda: hf_greedy(models["hf"], PROMPTS, NEW_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(str(models["hf"]))

    def stop_at(ids, k):  # two reference tokens as a stop text, first met at token k, between whole characters
        def spelled(n):
            return tokenizer.decode(ids[:n], skip_special_tokens=True)

        text, stop = spelled(len(ids)), tokenizer.decode(ids[k : k + 2], skip_special_tokens=True)
        whole = spelled(k) + stop == spelled(k + 2) and spelled(k - 1) != spelled(k) and "\ufffd" not in spelled(k + 2)
        return stop if whole and stop.strip() and "\n" not in stop and text.find(stop) == len(spelled(k)) else None

    # a random model's answers may repeat one token (no stop text first met past the start): take one that does not
    number, ids, k = next(((n, ids, k) for n, ids in sorted(enumerate(reference), key=lambda item: -len(item[1]))
                           for k in range(2, len(ids) - 2) if stop_at(ids, k)), (None, None, None))
    assert k is not None, reference
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stop = stop_at(ids, k)
    [record] = generate_cli(models["ckpt"], PROMPTS[number], f"max_new_tokens={NEW_TOKENS}", f"stop={stop}")
    assert (record["text"], record["tokens"], record["finish_reason"]) == (text[: text.index(stop)], ids[:k], "stop")


def test_the_tokenizer_must_be_the_one_the_checkpoint_recorded(data_cache, tmp_path):
    """A run on an older build of the built-in tokenizer finds that build in the cache; a tokenizer that is
    none of the cached ones is refused (its ids would name other tokens, silently)."""
    import shutil

    from data_support import small_cfg
    from megatron_recipes.checkpoint import IDENTITY_KEY
    from megatron_recipes.data.prompts import TokenizerMismatch, run_tokenizer

    current = small_builtin(data_cache).tokenizer_dir
    cache = tmp_path / "cache"
    shutil.copytree(current.parent, cache / "builtin" / current.parent.name)  # today's build
    older = _tokenizer_without_turn_tokens(cache / "builtin" / "an-older-build" / "tokenizer")  # yesterday's
    cfg = small_cfg(cache, "data.kind=sft", "data.sft_path=builtin")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def recorded(tokenizer):
        return {IDENTITY_KEY: {"tokenizer_sha": tokenizer.unique_identifiers["tokenizer_sha"]}}

    got = run_tokenizer(cfg, ckpt, recorded(older))
    assert got.unique_identifiers == older.unique_identifiers and got.source != current
    today = run_tokenizer(cfg, ckpt, {})  # a checkpoint that recorded none: as found
    assert run_tokenizer(cfg, ckpt, recorded(today)).unique_identifiers == today.unique_identifiers
    with pytest.raises(TokenizerMismatch, match="not the one checkpoint"):
        run_tokenizer(cfg, ckpt, {IDENTITY_KEY: {"tokenizer_sha": "0" * 16}})
