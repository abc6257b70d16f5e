"""The one reader of a local Hugging Face tokenizer folder, for ``data preprocess`` and the training ranks.

Both take the same facts from ``read_tokenizer_dir`` (the encoder, the EOD id appended to every document
and masked at its end, the pad id, the vocabulary size the embedding must hold), so a dataset is always
preprocessed with the EOD the trainer masks. The ids are always the ones transformers' ``AutoTokenizer``
gives. Where it would build exactly the backend of ``tokenizer.json`` with the special tokens of
``tokenizer_config.json``, the Rust ``tokenizers`` library reads the folder alone (importing transformers
costs seconds in every process). Everywhere else the facts are ``AutoTokenizer``'s and ``via`` says why:
a tokenizer class with its own construction, special tokens missing from ``tokenizer.json``,
``add_prefix_space``/``legacy``/``add_bos_token``, no ``tokenizer_config.json``, or a
``special_tokens_map.json`` that says more than the config (transformers versions differ in which wins).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_recipes.config.errors import RecipeError

_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
# transformers builds these classes' backend exactly from tokenizer.json (no class-specific rewrite)
_PLAIN_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
_BACKEND_CHANGING_KEYS = ("add_prefix_space", "legacy", "from_slow", "add_bos_token", "add_eos_token", "auto_map")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class TokenizerFacts:
    """What preprocessing and training read from a tokenizer folder (``read_tokenizer_dir``)."""

    backend: object  # tokenizers.Tokenizer encoding as AutoTokenizer does
    eod: int
    pad: Optional[int]
    vocab_size: int  # with added tokens, as len(AutoTokenizer)
    source: str
    via: str  # "tokenizer.json" or "transformers (<reason>)"
    split_special_tokens: bool = False  # special-token text is encoded as plain text (as hf(text) does)
    hf: object = None  # the transformers tokenizer, where it was loaded


def token_content(token) -> Optional[str]:
    return token.get("content") if isinstance(token, dict) else token


def find_eod(eos_id: Optional[int], token_to_id: Callable[[str], Optional[int]], source: str) -> int:
    """The end-of-document id: the eos token, else the first known EOD-like token of the vocabulary."""
    if eos_id is not None:
        return int(eos_id)
    for token in _EOD_CANDIDATES:
        if token_to_id(token) is not None:
            return int(token_to_id(token))
    raise RecipeError(
        f"tokenizer '{source}' has no end-of-document token (no eos_token and none of {', '.join(_EOD_CANDIDATES)})",
        fix='set "eos_token" in its tokenizer_config.json',
    )


def _map_says_more(backend, config: dict, special_map: dict) -> Optional[str]:
    """Why ``special_tokens_map.json`` may change what transformers builds (it is merged over the config by
    transformers 4, and by 5 only where the config has no ``added_tokens_decoder``), or None."""
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    for key, value in special_map.items():
        if isinstance(value, (list, dict)):  # additional/extra special tokens
            for token in value.values() if isinstance(value, dict) else value:
                if token_content(token) not in special:
                    return f"special_tokens_map.json's {key} {token_content(token)!r} is not a special token of tokenizer.json"
        elif token_content(value) != token_content(config.get(key)):
            return (f"special_tokens_map.json sets {key}={token_content(value)!r}, "
                    f"tokenizer_config.json {token_content(config.get(key))!r}")
    return None


def _needs_transformers(folder: Path, backend, config, special_map) -> Optional[str]:
    """Why transformers would build another tokenizer than ``tokenizer.json`` + its config alone, or None."""
    if config is None:
        return "no tokenizer_config.json"
    if not isinstance(config, dict) or not isinstance(special_map or {}, dict):
        return "tokenizer_config.json or special_tokens_map.json is not an object"
    cls = config.get("tokenizer_class")
    if cls not in _PLAIN_CLASSES:
        return f"tokenizer_class={cls}"
    if cls is None and (folder / "config.json").is_file():
        return "no tokenizer_class (transformers picks one from config.json)"
    for key in _BACKEND_CHANGING_KEYS:
        if key in config:
            return f"{key} in tokenizer_config.json"
    for key in _SPECIAL_KEYS:
        content = token_content(config.get(key))
        if content is not None and backend.token_to_id(content) is None:
            return f"{key} '{content}' is not in tokenizer.json"
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if backend.token_to_id(token_content(token)) != int(token_id):
            return f"added token {token_content(token)!r} differs from tokenizer.json"
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    for token in extra if isinstance(extra, list) else []:
        if backend.token_to_id(token_content(token)) is None:
            return f"special token {token_content(token)!r} is not in tokenizer.json"
    return _map_says_more(backend, config, special_map) if special_map else None


def _read_json(path: Path):
    """A JSON file's content, None when absent; RecipeError when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RecipeError(f"cannot read {path}: {exc}", fix="write it with save_pretrained()") from None


def _read_backend(folder: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # the Rust library raises a plain Exception for every parse error
        raise RecipeError(
            f"cannot load {folder / 'tokenizer.json'}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            fix="the folder must hold tokenizer.json as written by save_pretrained()",
        ) from None


def read_tokenizer_dir(path) -> TokenizerFacts:
    """A local folder written by ``save_pretrained`` -> its facts (no downloads, no code from the folder)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise RecipeError(
            f"tokenizer directory '{path}' does not exist",
            fix="give a local folder saved with tokenizer.save_pretrained(), or tokenizer=builtin",
        )
    if not (folder / "tokenizer.json").is_file():
        return facts_from_transformers(load_with_transformers(folder, path), folder, "no tokenizer.json")
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    backend = _read_backend(folder)
    reason = _needs_transformers(folder, backend, config, special_map)
    if reason is not None:
        return facts_from_transformers(load_with_transformers(folder, path), folder, reason)
    eos, pad = token_content(config.get("eos_token")), token_content(config.get("pad_token"))
    return TokenizerFacts(
        backend=backend,
        eod=find_eod(backend.token_to_id(eos) if eos is not None else None, backend.token_to_id, str(folder)),
        pad=backend.token_to_id(pad) if pad is not None else None,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        source=str(folder),
        via="tokenizer.json",
        split_special_tokens=bool(config.get("split_special_tokens", False)),
    )


def facts_from_transformers(hf, folder: Path, reason: str) -> TokenizerFacts:
    """The facts of a loaded transformers tokenizer (its backend, eos/pad ids and ``len``)."""
    return TokenizerFacts(
        backend=hf.backend_tokenizer,
        eod=find_eod(hf.eos_token_id, lambda token: hf.get_vocab().get(token), str(folder)),
        pad=hf.pad_token_id,
        vocab_size=len(hf),
        source=str(folder),
        via=f"transformers ({reason})",
        split_special_tokens=bool(getattr(hf, "split_special_tokens", False)),
        hf=hf,
    )


def load_with_transformers(folder: Path, path=None):
    """``AutoTokenizer`` on a local folder: fast tokenizers only, never the folder's own code."""
    from transformers import AutoTokenizer

    path = folder if path is None else path
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


def load_preprocess_tokenizer(tokenizer: str) -> TokenizerFacts:
    """``builtin`` or a local folder -> the facts, the backend set to encode as ``hf(text)`` does."""
    if tokenizer == "builtin":
        from megatron_recipes.data.builtin import builtin_data_for

        tokenizer = str(builtin_data_for(None).tokenizer_dir)
    facts = read_tokenizer_dir(tokenizer)
    facts.backend.encode_special_tokens = facts.split_special_tokens
    return facts
