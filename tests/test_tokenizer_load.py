"""The trainer's tokenizer load: a plain fast tokenizer is read from ``tokenizer.json`` with the Rust
library alone (no transformers or megatron-core import until needed), and gives exactly what
``AutoTokenizer`` gives, through megatron-core's tokenizer interface."""

from __future__ import annotations

import subprocess
import sys

import pytest

from data_support import small_builtin
from megatron_recipes.data.fast_tokenizer import facts_from_transformers, load_with_transformers
from megatron_recipes.data.tokenizer import RecipeTokenizer, load_tokenizer_dir


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory):
    return small_builtin(tmp_path_factory.mktemp("cache")).tokenizer_dir


def _variants(builtin_dir, root):
    """The built-in tokenizer, and re-saved by transformers with a pad token, with chat specials."""
    yield "builtin", builtin_dir
    hf = load_with_transformers(builtin_dir)
    hf.add_special_tokens({"pad_token": "<pad>"})
    hf.save_pretrained(str(root / "pad"))
    yield "pad", root / "pad"
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.save_pretrained(str(root / "chat"))
    yield "chat", root / "chat"


def test_rust_path_gives_what_autotokenizer_gives(builtin_dir, tmp_path):
    fast_paths = 0
    for name, folder in _variants(builtin_dir, tmp_path):
        got = load_tokenizer_dir(folder)
        fast_paths += got._hf is None
        want = RecipeTokenizer(facts_from_transformers(load_with_transformers(folder), folder, "the reference"))
        assert (got.eod, got._pad, got.vocab_size) == (want.eod, want._pad, want.vocab_size), name
        assert got.unique_identifiers == want.unique_identifiers, name  # the dataset cache key
        text = "Hello world, <|im_end|> 123"
        assert got.tokenize(text) == want.tokenize(text), name  # through .hf, loaded on first use
        assert got.hf is not None and got.detokenize(got.tokenize(text)) == want.detokenize(want.tokenize(text))
    assert fast_paths >= 1  # at least the built-in tokenizer takes the Rust path


def test_trainer_tokenizer_load_imports_nothing_heavy(builtin_dir):
    code = ("import sys\nfrom megatron_recipes.data.tokenizer import load_tokenizer_dir\n"
            f"tok = load_tokenizer_dir({str(builtin_dir)!r})\n"
            "print('eod', tok.eod, 'heavy:', [m for m in ('transformers', 'megatron.core', 'torch') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "heavy: []" in proc.stdout


def test_recipe_tokenizer_has_megatron_core_tokenizer_interface(builtin_dir):
    """megatron-core reads a tokenizer's attributes and never checks its class; ours has every one."""
    from megatron.core.tokenizers import MegatronTokenizerBase

    tok = load_tokenizer_dir(builtin_dir)
    missing = sorted(name for name in MegatronTokenizerBase.__abstractmethods__ if not hasattr(tok, name))
    assert missing == [] and tok.path == str(builtin_dir)
    assert isinstance(tok.vocab_size, int) and tok.vocab() == tok.hf.get_vocab()
