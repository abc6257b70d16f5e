"""`data preprocess` and the training ranks read the same facts from a tokenizer folder.

A dataset preprocessed with one EOD id and trained with another trains silently wrong (the trainer
masks and resets at its own EOD), so for realistic Hugging Face folders (Llama-3, Qwen, GPT-2 style,
and older layouts whose special tokens live in ``special_tokens_map.json``) the preprocessed ``.bin``
must end every document with the trainer's EOD and hold the trainer's token ids, and the vocabulary
size checked against the embedding must be the one the ids come from; transformers' ``AutoTokenizer``
(the installed version) is the reference both are held to. Folders are built here from a tiny BPE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_support import write_jsonl

TEXTS = ["def f(x):\n    return x + 1", "hello world <|im_start|> hi <|eot_id|> <tool>bye", "caf\u00e9 \U0001f600 ok"]
_SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]


def _backend(bos_template: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 10, trainer)
    if bos_template:  # Llama-3's tokenizer.json prepends <|begin_of_text|> when special tokens are added
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def _added_tokens_decoder(tok) -> dict:
    return {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for i, t in sorted(tok.get_added_tokens_decoder().items())}


def _folder(root: Path, name: str, config=None, special_map=None, bos_template=False, decoder=False) -> Path:
    folder = root / name
    folder.mkdir()
    if name == "model_folder_without_class":  # a model's folder: transformers picks the class from config.json
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2}))
    tok = _backend(bos_template)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        config = {**config, "added_tokens_decoder": _added_tokens_decoder(tok)} if decoder else config
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return folder


# name -> (tokenizer_config.json, special_tokens_map.json, tokenizer.json adds BOS, config lists added_tokens_decoder,
#          the EOD token both must use, or None where the installed transformers decides)
_FAST = "PreTrainedTokenizerFast"
CASES = {
    "llama3": ({"tokenizer_class": _FAST, "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                "model_max_length": 131072}, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, True, True,
               "<|end_of_text|>"),
    "llama3_instruct_stale_map": ({"tokenizer_class": _FAST, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                                  {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, True, True, None),
    "qwen": ({"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "errors": "replace", "split_special_tokens": False}, None, False, True, "<|im_end|>"),
    "gpt2": ({"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>", "add_prefix_space": False},
             {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, False, False,
             "<|endoftext|>"),
    "map_only": (None, {"eos_token": "<|eot_id|>"}, False, False, "<|eot_id|>"),
    "config_without_eos": ({"tokenizer_class": _FAST, "model_max_length": 2048}, {"eos_token": "<|eot_id|>"}, False, False,
                           "<|eot_id|>"),
    "legacy_map_overrides": ({"tokenizer_class": _FAST, "eos_token": "<|endoftext|>"}, {"eos_token": "<|eot_id|>"}, False,
                             False, None),
    "map_adds_specials": ({"tokenizer_class": _FAST, "eos_token": "<|endoftext|>"},
                          {"eos_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<tool>"]},
                          False, False, "<|endoftext|>"),
    "bare": (None, None, False, False, "<|endoftext|>"),
    "model_folder_without_class": ({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, None, True, True,
                                   "<|end_of_text|>"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: _folder(root, name, config, smap, bos, decoder) for name, (config, smap, bos, decoder, _) in CASES.items()}


def _reference(folder: Path, expected_token):
    """The installed transformers' tokenizer and EOD (its eos; a folder without one: the expected fallback)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return hf, hf.eos_token_id if hf.eos_token_id is not None else hf.convert_tokens_to_ids(expected_token)


@pytest.mark.parametrize("name", list(CASES))
def test_preprocess_and_training_read_the_same_facts(name, folders, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_recipes.data.fast_tokenizer import load_preprocess_tokenizer
    from megatron_recipes.data.preprocess import preprocess
    from megatron_recipes.data.tokenizer import load_tokenizer_dir

    folder = folders[name]
    expected_token = CASES[name][-1]
    hf, want_eod = _reference(folder, expected_token)
    if expected_token is not None:  # the folder's intent, where every transformers version agrees on it
        assert hf.convert_ids_to_tokens(want_eod) == expected_token
    pre, train = load_preprocess_tokenizer(str(folder)), load_tokenizer_dir(folder)
    # The EOD appended to documents, the vocabulary size (dtype; embedding check), the pad id.
    assert (pre.eod, pre.vocab_size) == (train.eod, train.vocab_size) == (want_eod, len(hf)), pre.via
    want_pad = hf.pad_token_id if hf.pad_token_id not in (None, want_eod) else None
    assert train._pad == want_pad  # preprocessing reads it from the same facts (it does not use it)
    for text in TEXTS:  # ids, with and without the special tokens (BOS) the folder's tokenizer adds
        for special in (False, True):
            assert pre.backend.encode(text, add_special_tokens=special).ids == hf(text, add_special_tokens=special)["input_ids"]
        assert train.tokenize(text) == hf(text, add_special_tokens=False)["input_ids"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    preprocess(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), str(folder), workers=1, show_progress=False)
    written = IndexedDataset(str(tmp_path / "out"))
    assert [written[i].tolist() for i in range(len(written))] == [train.tokenize(t) + [train.eod] for t in TEXTS]


def test_preprocess_through_transformers_imports_no_megatron_core(folders):
    """A folder read through transformers costs preprocessing transformers' import, never megatron-core's."""
    import subprocess
    import sys

    code = ("import sys\nfrom megatron_recipes.data.fast_tokenizer import load_preprocess_tokenizer\n"
            f"tok = load_preprocess_tokenizer({str(folders['gpt2'])!r})\n"
            "print(tok.via, 'megatron.core' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "transformers (tokenizer_class=GPT2Tokenizer) False"
