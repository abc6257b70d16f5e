"""megatron-core indexed datasets (``.bin``/``.idx``): checked before reading, written atomically.

megatron-core reads these files with ``assert`` and raw ``memmap``; a truncated file then fails deep
inside a data worker, or silently reads garbage. We check the header and every size against the
``.idx`` first and name the file and the fix. (Writers: ``idx_writer`` for `data preprocess`, and the
built-in corpus, which is built in a temporary folder renamed into place when complete.)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Type

import numpy as np

from megatron_recipes.config.errors import RecipeError

_HEADER = b"MMIDIDX\x00\x00"
_FIXED = len(_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence count, document count


@dataclass(frozen=True)
class IndexedInfo:
    """What an indexed dataset holds, as read from its ``.idx``."""

    prefix: str
    num_sequences: int
    num_documents: int
    num_tokens: int
    dtype: Type[np.number]
    max_token_id: Optional[int] = None  # from <prefix>.stats.json (data preprocess writes it), when present


def _redo(prefix: str) -> str:
    return f"re-create it with `megatron-recipes data preprocess ... output_prefix={prefix}`, or fix the path"


def check_indexed_prefix(prefix: str) -> IndexedInfo:
    """Validate ``<prefix>.bin``/``<prefix>.idx`` (existence, header, sizes); raise RecipeError if bad."""
    from megatron.core.datasets.indexed_dataset import DType

    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    missing = [str(p) for p in (idx, bin_) if not p.is_file()]
    if missing:
        hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise RecipeError(f"indexed dataset '{prefix}': missing {', '.join(missing)}{hint}", fix=_redo(prefix))
    idx_size = idx.stat().st_size
    try:
        with open(idx, "rb") as handle:
            head = handle.read(_FIXED)
    except OSError as exc:
        raise RecipeError(f"cannot read {idx}: {exc.strerror}", fix="check the file's permissions") from None
    if len(head) < _FIXED or head[: len(_HEADER)] != _HEADER:
        raise RecipeError(f"{idx} is not a megatron-core index file (bad or short header)", fix=_redo(prefix))
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(_HEADER) :])
    if version != 1:
        raise RecipeError(f"{idx}: unsupported index version {version}", fix=_redo(prefix))
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise RecipeError(f"{idx}: unknown token dtype code {code}", fix=_redo(prefix)) from None
    expected_idx = _FIXED + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if idx_size not in (expected_idx, expected_idx + n_seq):  # + one mode byte per sequence if multimodal
        raise RecipeError(
            f"{idx} is truncated or corrupt: {idx_size} bytes, its header promises {expected_idx} "
            f"({n_seq} sequences, {n_doc} document boundaries)",
            fix=_redo(prefix),
        )
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=_FIXED, shape=(n_seq,)) if n_seq else np.zeros(0)
    num_tokens = int(lengths.sum(dtype=np.int64))
    expected_bin = num_tokens * np.dtype(dtype).itemsize
    bin_size = bin_.stat().st_size
    if bin_size != expected_bin:
        state = "truncated" if bin_size < expected_bin else "longer than its index says"
        raise RecipeError(
            f"{bin_} is {state}: {bin_size} bytes, {idx.name} describes {num_tokens} tokens of "
            f"{np.dtype(dtype).name} = {expected_bin} bytes",
            fix=_redo(prefix),
        )
    if n_doc < 1:
        raise RecipeError(f"{idx}: no document boundaries", fix=_redo(prefix))
    from megatron_recipes.data.idx_writer import read_stats

    top = read_stats(prefix).get("max_token_id")
    return IndexedInfo(prefix, int(n_seq), int(n_doc) - 1, num_tokens, dtype, top if isinstance(top, int) else None)


def check_fits_vocab(info: IndexedInfo, vocab_size: int) -> None:
    """Refuse, before any rank starts, a dataset whose recorded largest id is outside the model's vocabulary
    (the trainer also checks every micro-batch: datasets written without a stats record)."""
    if info.max_token_id is not None and info.max_token_id >= vocab_size:
        raise RecipeError(
            f"indexed dataset '{info.prefix}' holds token ids up to {info.max_token_id} ({info.prefix}.stats.json), "
            f"but model.vocab_size={vocab_size}: it was tokenized for a larger vocabulary",
            fix="preprocess it with the model's tokenizer (data.tokenizer), or use a model whose vocab_size "
            f"is above {info.max_token_id}",
        )


_FINGERPRINTS: dict = {}


def content_fingerprint(prefix: str) -> dict:
    """What identifies an indexed dataset's content: sizes and mtimes of both files and the ``.idx`` hash.

    megatron-core keys its index caches on the prefix's path; a dataset re-written at the same path
    would then be read through the old document/sample indices (IndexError, or silently wrong samples).
    The hash is memoised per (path, size, mtime) within a process.
    """
    import hashlib

    idx, bin_ = os.stat(prefix + ".idx"), os.stat(prefix + ".bin")
    stamp = (prefix, idx.st_size, idx.st_mtime_ns, bin_.st_size, bin_.st_mtime_ns)
    if stamp not in _FINGERPRINTS:
        digest = hashlib.sha256()
        with open(prefix + ".idx", "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        _FINGERPRINTS[stamp] = {
            "idx_sha256": digest.hexdigest(),
            "idx_size": idx.st_size,
            "idx_mtime_ns": idx.st_mtime_ns,
            "bin_size": bin_.st_size,
            "bin_mtime_ns": bin_.st_mtime_ns,
        }
    return _FINGERPRINTS[stamp]


def token_dtype(vocab_size: int, requested: str = "auto") -> Type[np.number]:
    """The ``.bin`` token dtype (see ``idx_writer.token_dtype``, which needs no megatron-core import)."""
    from megatron_recipes.data.idx_writer import token_dtype as _token_dtype

    return _token_dtype(vocab_size, requested)
