"""megatron-core's ``.bin/.idx`` format written without importing megatron-core (or torch).

``megatron.core.datasets.indexed_dataset`` imports all of megatron-core and torch, seconds of start-up
for a command whose output is two flat files. This writer produces byte-identical files to
``IndexedDatasetBuilder`` + ``finalize`` for one sequence per document (the tests compare both, and
read the result back with megatron-core's ``IndexedDataset``). Tokens stream to a temporary ``.bin``
batch by batch; only the per-document lengths (4 bytes each) stay in memory. Both files are renamed
into place only when complete, so an interrupted run never leaves a pair that looks usable.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Type

import numpy as np

from megatron_recipes.config.errors import RecipeError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# megatron.core.datasets.indexed_dataset.DType codes (checked against it in the tests)
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}
_REQUESTABLE = {"uint16": np.uint16, "int32": np.int32, "int64": np.int64}
# <prefix>.stats.json beside the pair: what training checks before reading a token (the largest id must fit
# the model's vocabulary); megatron-core never reads it
STATS_SUFFIX = ".stats.json"


def optimal_dtype(vocab_size: int) -> Type[np.number]:
    """megatron-core's ``DType.optimal_dtype``: uint16 below 65,500 entries, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def token_dtype(vocab_size: int, requested: str = "auto") -> Type[np.number]:
    """The ``.bin`` token dtype: megatron-core's choice for ``auto``; an error if ids would not fit."""
    if requested == "auto":
        return optimal_dtype(vocab_size)
    if requested not in _REQUESTABLE:
        raise RecipeError(f"dtype={requested} is not supported", fix=f"use one of auto, {', '.join(_REQUESTABLE)}")
    dtype = _REQUESTABLE[requested]
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise RecipeError(
            f"dtype={requested} holds token ids up to {np.iinfo(dtype).max}, but the tokenizer's vocab has "
            f"{vocab_size} entries",
            fix="use dtype=auto (or int32)",
        )
    return dtype


class IndexedWriter:
    """Append documents (one sequence each) to ``<prefix>.bin``; ``commit()`` writes ``.idx`` and publishes."""

    def __init__(self, prefix: str, dtype: Type[np.number]) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._code = DTYPE_CODES[self.dtype.type]
        tag = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = prefix + ".bin" + tag, prefix + ".idx" + tag
        self._bin = open(self.tmp_bin, "wb", buffering=0)
        self._lengths = []  # one int32 array per batch
        self.documents = 0
        self.tokens = 0
        self.max_token_id = -1

    def add_batch(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """``tokens``: the documents' ids back to back (already in ``dtype``); ``lengths``: each > 0."""
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, the file holds {self.dtype}")
        self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.documents += len(lengths)
        self.tokens += int(tokens.size)
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def commit(self) -> None:
        """Write the index, flush both files to disk, then rename ``.bin`` and finally ``.idx`` into place."""
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self.tmp_idx, "wb") as idx:
            idx.write(HEADER + struct.pack("<Q", VERSION) + struct.pack("<B", self._code))
            idx.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices)))
            for array in (lengths, pointers, doc_indices):
                idx.write(array.tobytes(order="C"))
            idx.flush()
            os.fsync(idx.fileno())
        os.fsync(self._bin.fileno())
        self._bin.close()
        for stale in (".idx", STATS_SUFFIX):  # never a new .bin next to the old .idx (or stats) under the final names
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.prefix + stale)
        os.replace(self.tmp_bin, self.prefix + ".bin")
        os.replace(self.tmp_idx, self.prefix + ".idx")
        write_stats(self.prefix, self.max_token_id, self.tokens, self.documents)

    def discard(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        for path in (self.tmp_bin, self.tmp_idx):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def write_stats(prefix: str, max_token_id: int, tokens: int, documents: int) -> None:
    """``<prefix>.stats.json`` for a published pair (its .bin size ties the record to that file)."""
    from megatron_recipes import files

    record = {"max_token_id": int(max_token_id), "tokens": int(tokens), "documents": int(documents),
              "bin_size": os.path.getsize(prefix + ".bin")}
    files.write_text(prefix + STATS_SUFFIX, json.dumps(record, sort_keys=True) + "\n")


def read_stats(prefix: str) -> dict:
    """The stats record of ``prefix`` when it is there and describes the current .bin, else {}."""
    try:
        with open(prefix + STATS_SUFFIX, encoding="utf-8") as handle:
            record = json.load(handle)
        if isinstance(record, dict) and record.get("bin_size") == os.path.getsize(prefix + ".bin"):
            return record
    except (OSError, ValueError):
        pass
    return {}


@contextlib.contextmanager
def indexed_writer(prefix: str, dtype: Type[np.number]):
    """An ``IndexedWriter`` whose temporaries are removed whatever happens; published on a clean exit."""
    writer = IndexedWriter(prefix, dtype)
    try:
        yield writer
        writer.commit()
    finally:
        writer.discard()
