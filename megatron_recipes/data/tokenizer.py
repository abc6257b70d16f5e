"""Tokenizers for a recipe: the built-in one or a local Hugging Face directory, checked against the model.

``RecipeTokenizer`` wraps the HF fast tokenizer (``.hf``) and exposes what megatron-core's datasets
read from a tokenizer (``eod``, ``pad``, ``vocab_size``, ``unique_identifiers``), so the same object
goes into ``GPTDatasetConfig`` and into the SFT templating code.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig

BUILTIN = "builtin"
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class RecipeTokenizer(MegatronTokenizerBase):
    """An HF fast tokenizer seen through megatron-core's tokenizer interface.

    What a pretraining rank reads (``eod``, ``pad``, ``vocab_size``, ``unique_identifiers``) can come
    straight from ``tokenizer.json`` (``load_tokenizer_dir``'s Rust path); the transformers tokenizer
    (``.hf``: encoding, decoding, chat templates) is then loaded on first use only.
    """

    def __init__(self, source: str, backend_json: str, eod: int, pad: Optional[int], vocab_size: int, hf=None) -> None:
        super().__init__(source, {})
        self._hf = hf
        self.source = source
        self._eod = eod
        self._pad = pad if pad is not None and pad != self._eod else None
        self._vocab_size = vocab_size
        digest = hashlib.sha256(backend_json.encode("utf-8")).hexdigest()[:16]
        # Enters megatron-core's dataset cache key: content, not path, so a moved tokenizer still hits.
        self.unique_identifiers = OrderedDict(
            [("class", "RecipeTokenizer"), ("tokenizer_sha", digest), ("vocab_size", self.vocab_size)]
        )

    @classmethod
    def from_hf(cls, hf, source: str) -> "RecipeTokenizer":
        return cls(source, hf.backend_tokenizer.to_str(), _find_eod(hf, source), hf.pad_token_id, len(hf), hf)

    @property
    def hf(self):
        """The transformers tokenizer (loaded now if the Rust path built this object)."""
        if self._hf is None:
            self._hf = _load_with_transformers(Path(self.source), self.source)
        return self._hf

    @property
    def vocab_size(self) -> int:  # includes added special tokens, as len(AutoTokenizer)
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """Padding id distinct from EOD; megatron-core falls back to -1 when this raises."""
        if self._pad is None:
            raise AttributeError("tokenizer has no pad token distinct from EOD")
        return self._pad

    @property
    def pad_or_eod(self) -> int:
        """The id to put in padded positions (they are always loss-masked)."""
        return self._pad if self._pad is not None else self._eod

    def vocab(self):
        return self.hf.get_vocab()

    def tokenize(self, text: str) -> List[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: List[int]) -> str:
        return self.hf.decode(ids)

    def apply_chat_template(self, conversation, **kwargs):
        return self.hf.apply_chat_template(conversation, **kwargs)


def _find_eod(hf, source: str) -> int:
    if hf.eos_token_id is not None:
        return int(hf.eos_token_id)
    vocab = hf.get_vocab()
    for token in _EOD_CANDIDATES:
        if token in vocab:
            return int(vocab[token])
    raise RecipeError(
        f"tokenizer '{source}' has no end-of-document token (no eos_token and none of {', '.join(_EOD_CANDIDATES)})",
        fix='set "eos_token" in its tokenizer_config.json',
    )


def load_tokenizer_dir(path: str | Path) -> RecipeTokenizer:
    """A local HF tokenizer directory (tokenizer.json + tokenizer_config.json). No downloads.

    A plain fast tokenizer is read with the Rust ``tokenizers`` library alone (transformers' import and
    ``AutoTokenizer`` cost about 1.5 s of CPU in every rank); folders whose config makes transformers
    build something else, and every folder the Rust path cannot read, go through transformers."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise RecipeError(
            f"tokenizer directory '{path}' does not exist",
            fix="give a local folder saved with tokenizer.save_pretrained(), or tokenizer=builtin",
        )
    fast = _from_tokenizer_json(folder)
    if fast is not None:
        return fast
    return RecipeTokenizer.from_hf(_load_with_transformers(folder, path), str(folder))


def _from_tokenizer_json(folder: Path) -> Optional[RecipeTokenizer]:
    """The Rust path: only where ``fast_tokenizer`` finds transformers would build the very same backend
    from ``tokenizer.json`` and every special token comes from ``tokenizer_config.json``; else None."""
    from megatron_recipes.data import fast_tokenizer

    if (folder / "special_tokens_map.json").exists() or not (folder / "tokenizer_config.json").is_file():
        return None  # transformers reads special tokens from the map too; no config: let it decide
    try:
        backend, config, reason = fast_tokenizer.read_tokenizer_json(folder)
        if reason is not None:
            return None
        eod = fast_tokenizer.find_eod(backend, config, str(folder))
    except Exception:  # unreadable or unusual: transformers loads it, or gives its clear error
        return None
    pad_token = fast_tokenizer.token_content(config.get("pad_token"))
    pad = backend.token_to_id(pad_token) if pad_token is not None else None
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    return RecipeTokenizer(str(folder), backend.to_str(), eod, pad, vocab_size)


def _load_with_transformers(folder: Path, path) -> object:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, use_fast=True, trust_remote_code=False  # never run auto_map code
        )
    except Exception as exc:  # transformers raises many types (OSError, ValueError, JSON errors)
        raise RecipeError(
            f"cannot load a tokenizer from '{path}': {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            fix="the folder must hold tokenizer.json (a fast tokenizer) as written by save_pretrained()",
        ) from None
    if not getattr(hf, "is_fast", False):
        raise RecipeError(
            f"tokenizer '{path}' has no fast (Rust) implementation",
            fix="convert it once with transformers and save_pretrained() so that tokenizer.json exists",
        )
    return hf


def tokenizer_source(tokenizer: str, cfg: Optional[RunConfig] = None) -> RecipeTokenizer:
    """``builtin`` (built or reused from the cache) or a local directory."""
    if tokenizer == BUILTIN:
        from megatron_recipes.data.builtin import builtin_data_for

        data = cfg.data if cfg is not None else None
        return load_tokenizer_dir(builtin_data_for(data).tokenizer_dir)
    return load_tokenizer_dir(tokenizer)


def check_fits_model(tokenizer: RecipeTokenizer, cfg: RunConfig) -> None:
    """Every token id must have an embedding row: vocab <= model.vocab_size."""
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise RecipeError(
            f"tokenizer '{cfg.data.tokenizer}' has {tokenizer.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}: ids >= {cfg.model.vocab_size} would have no embedding row",
            fix=f"set model.vocab_size={tokenizer.vocab_size} (or larger), or use the model's own tokenizer",
        )


def load_tokenizer(cfg: RunConfig) -> RecipeTokenizer:
    """The recipe's tokenizer (``data.tokenizer``), checked against ``model.vocab_size``."""
    tokenizer = tokenizer_source(cfg.data.tokenizer, cfg)
    check_fits_model(tokenizer, cfg)
    return tokenizer
