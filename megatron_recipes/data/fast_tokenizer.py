"""The tokenizer for ``data preprocess``: the Rust ``tokenizers`` library reading ``tokenizer.json`` directly.

Importing transformers costs seconds of start-up and adds nothing for a plain fast tokenizer: its
``PreTrainedTokenizerFast`` wraps the very same ``tokenizers.Tokenizer`` built from ``tokenizer.json``.
It does change that backend when ``tokenizer_config.json`` asks for it (a tokenizer class with its own
construction, special tokens missing from ``tokenizer.json``, ``add_prefix_space``/``legacy``), so for
those folders we load through transformers instead and say so (``PreprocessTokenizer.via``): the
ids are always the ones ``AutoTokenizer`` gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from megatron_recipes.config.errors import RecipeError

_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")  # as data.tokenizer
# transformers builds these classes' backend exactly from tokenizer.json (no class-specific rewrite)
_PLAIN_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
_BACKEND_CHANGING_KEYS = ("add_prefix_space", "legacy", "from_slow", "add_bos_token", "add_eos_token", "auto_map")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class PreprocessTokenizer:
    backend: object  # tokenizers.Tokenizer
    eod: int
    vocab_size: int  # with added tokens, as len(AutoTokenizer)
    source: str
    via: str  # "tokenizer.json" or "transformers (<reason>)"


def token_content(token) -> Optional[str]:
    return token.get("content") if isinstance(token, dict) else token


def _needs_transformers(backend, config: dict) -> Optional[str]:
    """Why transformers would build a different backend than ``tokenizer.json`` alone, or None."""
    cls = config.get("tokenizer_class")
    if cls not in _PLAIN_CLASSES:
        return f"tokenizer_class={cls}"
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
    return None


def find_eod(backend, config: dict, source: str) -> int:
    eos = token_content(config.get("eos_token"))
    if eos is not None:
        return int(backend.token_to_id(eos))
    for token in _EOD_CANDIDATES:
        if backend.token_to_id(token) is not None:
            return int(backend.token_to_id(token))
    raise RecipeError(
        f"tokenizer '{source}' has no end-of-document token (no eos_token and none of {', '.join(_EOD_CANDIDATES)})",
        fix='set "eos_token" in its tokenizer_config.json',
    )


def _via_transformers(folder: Path, reason: str) -> PreprocessTokenizer:
    from megatron_recipes.data.tokenizer import load_tokenizer_dir

    tok = load_tokenizer_dir(folder)
    backend = tok.hf.backend_tokenizer
    backend.encode_special_tokens = bool(getattr(tok.hf, "split_special_tokens", False))  # as hf(text) does
    return PreprocessTokenizer(backend, tok.eod, tok.vocab_size, str(folder), f"transformers ({reason})")


def load_preprocess_tokenizer(tokenizer: str) -> PreprocessTokenizer:
    """``builtin`` or a local folder written by ``save_pretrained`` -> the Rust tokenizer, its EOD and size."""
    if tokenizer == "builtin":
        from megatron_recipes.data.builtin import builtin_data_for

        tokenizer = str(builtin_data_for(None).tokenizer_dir)
    folder = Path(tokenizer).expanduser()
    if not folder.is_dir():
        raise RecipeError(
            f"tokenizer directory '{tokenizer}' does not exist",
            fix="give a local folder saved with tokenizer.save_pretrained(), or tokenizer=builtin",
        )
    if not (folder / "tokenizer.json").is_file():
        return _via_transformers(folder, "no tokenizer.json")
    backend, config, reason = read_tokenizer_json(folder)
    if reason:
        return _via_transformers(folder, reason)
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    eod = find_eod(backend, config, str(folder))
    return PreprocessTokenizer(backend, eod, backend.get_vocab_size(with_added_tokens=True), str(folder), "tokenizer.json")


def read_tokenizer_json(folder: Path) -> Tuple[object, dict, Optional[str]]:
    """(the Rust tokenizer of ``tokenizer.json``, ``tokenizer_config.json`` ({} when absent), why transformers
    would build another backend from them, or None). Raises RecipeError when a file cannot be read."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as exc:
        raise RecipeError(f"cannot read {folder / 'tokenizer_config.json'}: {exc}", fix="write it with save_pretrained()") from None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # the Rust library raises a plain Exception for every parse error
        raise RecipeError(
            f"cannot load {folder / 'tokenizer.json'}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            fix="the folder must hold tokenizer.json as written by save_pretrained()",
        ) from None
    reason = _needs_transformers(backend, config) if isinstance(config, dict) else "tokenizer_config.json is not an object"
    return backend, config, reason
