"""Corpus -> megatron-core ``.bin/.idx``: ``datasets`` batched map with the Rust tokenizer, then one write.

Token ids never round-trip through Python lists between processes: workers tokenize whole batches
(``encode_batch_fast``) into an Arrow ``int32`` column on disk, and the writer reads that column back
as zero-copy NumPy slices into megatron-core's ``IndexedDatasetBuilder``. Output goes to temporary
names and is renamed into place at the end (``indexed.atomic_indexed_builder``); the ``datasets``
scratch folder is removed whatever happens.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.indexed import atomic_indexed_builder, token_dtype


@dataclass
class PreprocessSummary:
    output_prefix: str
    input_rows: int
    documents: int  # written (non-empty) documents
    empty: int  # documents with no tokens: skipped
    missing: int  # rows whose text field is null: skipped
    tokens: int
    bytes: int  # size of the .bin
    seconds: float

    @property
    def docs_per_s(self) -> float:
        return self.input_rows / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "docs_per_s": round(self.docs_per_s, 1), "tokens_per_s": round(self.tokens_per_s, 1)}


class BatchEncoder:
    """The ``datasets.map`` function: loads the tokenizer once per worker process, encodes whole batches."""

    def __init__(self, tokenizer_dir: str, text_key: str, eod: Optional[int], add_special_tokens: bool, threads: bool):
        self.tokenizer_dir, self.text_key, self.eod = tokenizer_dir, text_key, eod
        self.add_special_tokens, self.threads = add_special_tokens, threads
        self._backend = None

    def _load(self):
        if not self.threads:  # one process per core already: no Rust thread pool on top
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from megatron_recipes.data.tokenizer import load_tokenizer_dir

        hf = load_tokenizer_dir(self.tokenizer_dir).hf
        backend = hf.backend_tokenizer
        backend.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))  # as hf(text) does
        return backend

    def __call__(self, batch: dict) -> dict:
        if self._backend is None:
            self._backend = self._load()
        texts = batch[self.text_key]
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        encodings = encode([t if t else "" for t in texts], add_special_tokens=self.add_special_tokens)
        tail = [self.eod] if self.eod is not None else []
        return {"input_ids": [e.ids + tail if e.ids else [] for e in encodings]}


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="write .bin", unit="doc", disable=not enabled, dynamic_ncols=True)


def _write(tokenized, prefix: str, dtype, show_progress: bool):
    """Stream the Arrow token column into the builder in input order; returns (documents, empty, tokens)."""
    documents = empty = tokens = 0
    table = tokenized.data.table
    column = table.column("input_ids")
    with atomic_indexed_builder(prefix, dtype) as builder, _progress(len(tokenized), show_progress) as bar:
        for chunk in column.chunks:
            offsets = chunk.offsets.to_numpy()
            values = chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)  # honours slicing
            lengths = np.diff(offsets)
            base = int(offsets[0])
            for i in np.flatnonzero(lengths):
                start = int(offsets[i]) - base
                builder.add_document(values[start : start + int(lengths[i])], [int(lengths[i])])
            written = int(np.count_nonzero(lengths))
            documents += written
            empty += len(lengths) - written
            tokens += int(offsets[-1] - offsets[0])
            bar.update(len(lengths))
            bar.set_postfix(tokens_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f}")
    return documents, empty, tokens


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(prefix: str) -> None:
    """Scratch folders and temporary .bin/.idx left by a killed run (its process is gone)."""
    folder, name = Path(prefix).parent, Path(prefix).name
    if not folder.is_dir():
        return
    for path in list(folder.glob(f".{name}.preprocess-*")) + list(folder.glob(f"{name}.bin.tmp-*")) + list(
        folder.glob(f"{name}.idx.tmp-*")
    ):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def preprocess(
    input_spec: str,
    output_prefix: str,
    tokenizer: str,
    text_key: str = "text",
    workers: Optional[int] = None,
    append_eod: bool = True,
    dtype: str = "auto",
    split: Optional[str] = None,
    add_special_tokens: bool = False,
    batch_size: int = 1000,
    show_progress: bool = True,
) -> PreprocessSummary:
    """Tokenize every document (+ EOD) of the inputs, in order, into ``<output_prefix>.bin/.idx``."""
    import pyarrow.compute as pc
    from datasets import Features, List, Value, disable_progress_bars, enable_progress_bars

    from megatron_recipes.data.inputs import load_text_dataset
    from megatron_recipes.data.tokenizer import tokenizer_source

    started = time.perf_counter()
    workers = workers or len(os.sched_getaffinity(0))
    if workers < 1:
        raise RecipeError(f"workers={workers}", fix="workers >= 1")
    if output_prefix.endswith((".bin", ".idx")):
        raise RecipeError(f"output_prefix={output_prefix} ends in .bin/.idx", fix="give the prefix only, e.g. out/corpus_text_document")
    tok = tokenizer_source(tokenizer)
    out_dtype = token_dtype(tok.vocab_size, dtype)  # before any work: a too-narrow dtype is an error
    remove_stale_temporaries(output_prefix)
    scratch = Path(output_prefix).parent / f".{Path(output_prefix).name}.preprocess-{os.getpid()}"
    (enable_progress_bars if show_progress else disable_progress_bars)()
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        texts = load_text_dataset(input_spec, text_key, scratch / "inputs", split)
        missing = int(pc.sum(pc.is_null(texts.data.table.column(text_key))).as_py() or 0)
        procs = workers if workers > 1 and len(texts) >= 2 * batch_size else None
        encoder = BatchEncoder(tok.source, text_key, tok.eod if append_eod else None, add_special_tokens, threads=procs is None)
        tokenized = texts.map(
            encoder,
            batched=True,
            batch_size=batch_size,
            num_proc=procs,
            remove_columns=[text_key],
            features=Features({"input_ids": List(Value("int32"))}),
            cache_file_name=str(scratch / "tokens.arrow"),
            load_from_cache_file=False,
            new_fingerprint=f"tokens-{os.getpid()}-{time.time_ns()}",
            desc="tokenize",
        )
        documents, empty, tokens = _write(tokenized, output_prefix, out_dtype, show_progress)
        del tokenized, texts
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        enable_progress_bars()
    empty -= missing  # null rows tokenized to nothing too; report them separately
    return PreprocessSummary(
        output_prefix=output_prefix,
        input_rows=documents + empty + missing,
        documents=documents,
        empty=empty,
        missing=missing,
        tokens=tokens,
        bytes=os.path.getsize(output_prefix + ".bin"),
        seconds=time.perf_counter() - started,
    )


def print_summary(summary: PreprocessSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"preprocess -> {summary.output_prefix}.bin/.idx", show_header=False)
    rows = [
        ("input rows", f"{summary.input_rows:,}"),
        ("documents written", f"{summary.documents:,}"),
        ("empty documents (skipped)", f"{summary.empty:,}"),
        ("rows without the text field (skipped)", f"{summary.missing:,}"),
        ("tokens", f"{summary.tokens:,}"),
        (".bin bytes", f"{summary.bytes:,}"),
        ("seconds", f"{summary.seconds:.2f}"),
        ("documents/s", f"{summary.docs_per_s:,.0f}"),
        ("tokens/s", f"{summary.tokens_per_s:,.0f}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console(stderr=True).print(table)
