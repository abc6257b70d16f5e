"""Tokenizers for a recipe: the built-in one or a local Hugging Face directory, checked against the model.

``RecipeTokenizer`` exposes what megatron-core's datasets read from a tokenizer (``eod``, ``pad``,
``vocab_size``, ``unique_identifiers``) and the HF fast tokenizer (``.hf``) for the SFT templating code,
so the same object goes into ``GPTDatasetConfig`` and into SFT. Its facts come from
``fast_tokenizer.read_tokenizer_dir``, the reader ``data preprocess`` uses too: a dataset's EOD is the
trainer's. megatron-core is not imported here (its import costs seconds): its datasets read these
attributes, they never check the class.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.data.fast_tokenizer import TokenizerFacts, load_with_transformers, read_tokenizer_dir

BUILTIN = "builtin"


class RecipeTokenizer:
    """A tokenizer folder's facts through megatron-core's tokenizer interface (``MegatronTokenizerBase``'s
    methods; tests/test_tokenizer_load.py holds it to that class).

    What a pretraining rank reads can come straight from ``tokenizer.json`` (the Rust path of
    ``read_tokenizer_dir``); the transformers tokenizer (``.hf``: encoding, decoding, chat templates) is
    then loaded on first use only.
    """

    def __init__(self, facts: TokenizerFacts) -> None:
        self._hf = facts.hf
        self.source = self.path = facts.source
        self._eod = facts.eod
        self._pad = facts.pad if facts.pad is not None and facts.pad != facts.eod else None
        self._vocab_size = facts.vocab_size
        digest = hashlib.sha256(facts.backend.to_str().encode("utf-8")).hexdigest()[:16]
        # Enters megatron-core's dataset cache key: content, not path, so a moved tokenizer still hits.
        self.unique_identifiers = OrderedDict(
            [("class", "RecipeTokenizer"), ("tokenizer_sha", digest), ("vocab_size", self.vocab_size)]
        )

    @property
    def hf(self):
        """The transformers tokenizer (loaded now if the Rust path built this object)."""
        if self._hf is None:
            self._hf = load_with_transformers(Path(self.source))
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


def load_tokenizer_dir(path: str | Path) -> RecipeTokenizer:
    """A local HF tokenizer directory (tokenizer.json + tokenizer_config.json). No downloads."""
    return RecipeTokenizer(read_tokenizer_dir(path))


def tokenizer_source(tokenizer: str, cfg: Optional[RunConfig] = None, build_missing: bool = True) -> RecipeTokenizer:
    """``builtin`` (built or reused from the cache; refused when not built and ``build_missing`` is off)
    or a local directory."""
    if tokenizer == BUILTIN:
        from megatron_recipes.data.builtin import builtin_data_for

        data = cfg.data if cfg is not None else None
        built = builtin_data_for(data, build_missing)
        if built is None:
            where = data.cache_dir if data is not None and data.cache_dir else "the default data cache"
            raise RecipeError(
                f"the built-in tokenizer is not built in {where}",
                fix="run `megatron-recipes data builtin` with the run's data.* settings, or pass the tokenizer folder",
            )
        return load_tokenizer_dir(built.tokenizer_dir)
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
