"""Corpus -> megatron-core ``.bin/.idx`` in one process: streamed batches, the Rust tokenizer's threads.

Start-up is part of the cost users wait for, so this command imports only what it needs: the
``tokenizers`` library reading ``tokenizer.json`` (``fast_tokenizer``), NumPy, and one input reader
(``inputs``); no torch, megatron-core or transformers (transformers only for a folder it would read
differently). The tokenizer folder is read by the trainer's own reader, so the EOD appended here is
the one training masks. Parallelism is the Rust tokenizer's own thread
pool (``encode_batch_fast`` releases the GIL), so there are no worker processes holding copies of the
interpreter and no token lists pickled between them. Memory is bounded: a reader thread parses the
next batch (about ``batch_bytes`` of text) while the current one is tokenized, and each batch's ids go
straight to the ``.bin`` (``idx_writer``), which writes megatron-core's format byte for byte and
publishes both files atomically.
"""

from __future__ import annotations

import os
import re
import queue
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from megatron_recipes import files
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.idx_writer import STATS_SUFFIX, indexed_writer, token_dtype


@dataclass
class PreprocessSummary:
    output_prefix: str
    input_rows: int
    documents: int  # written (non-empty) documents
    empty: int  # documents with no tokens: skipped
    missing: int  # JSON lines without the text field: skipped
    tokens: int
    bytes: int  # size of the .bin
    seconds: float
    tokenizer_via: str = "tokenizer.json"  # how the tokenizer was loaded (fast_tokenizer)
    max_token_id: int = -1  # recorded in <prefix>.stats.json: training checks it against model.vocab_size
    invalid_unicode: int = 0  # documents whose lone surrogates were replaced by U+FFFD (counted, not hidden)
    pieced: int = 0  # documents longer than PIECE_CHARS, encoded piece by piece (bounded memory)

    @property
    def docs_per_s(self) -> float:
        return self.input_rows / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "docs_per_s": round(self.docs_per_s, 1), "tokens_per_s": round(self.tokens_per_s, 1)}


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


def check_output_prefix(output_prefix: str, overwrite: bool) -> None:
    """Refuse an existing dataset without ``overwrite``, and an output folder we cannot write, before any work."""
    if output_prefix.endswith((".bin", ".idx")):
        raise RecipeError(f"output_prefix={output_prefix} ends in .bin/.idx", fix="give the prefix only, e.g. out/corpus_text_document")
    existing = [output_prefix + e for e in (".bin", ".idx") if os.path.lexists(output_prefix + e)]
    if existing and not overwrite:
        raise RecipeError(
            f"output_prefix={output_prefix} already holds a dataset ({', '.join(existing)}); training runs and "
            "index caches built from it would see different data",
            fix="pass --overwrite to replace it, or choose another output_prefix",
        )
    if existing and os.path.lexists(output_prefix + STATS_SUFFIX):
        existing.append(output_prefix + STATS_SUFFIX)
    for path in existing:  # --overwrite replaces regular files only (files.py's rule), never a link or a device
        files.require_replaceable(path)
    folder = Path(output_prefix).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecipeError(f"cannot write output_prefix={output_prefix}: {exc.strerror} ({exc.filename or folder})",
                          fix="choose an output_prefix in a folder you can write to") from None
    why = files.cannot_write_in(folder)
    if why:
        raise RecipeError(f"cannot write output_prefix={output_prefix}: {why}",
                          fix="choose an output_prefix in a folder you can write to")


def _read_ahead(batches, depth: int = 2):
    """Run the input reader in a thread, ``depth`` batches ahead; its exceptions re-raise here."""
    out: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put(done)
        except BaseException as exc:  # handed to the consumer, raised there
            out.put(exc)

    thread = threading.Thread(target=produce, name="preprocess-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _set_threads(workers: int) -> None:
    """The Rust tokenizer's thread pool size (rayon reads it once, when the pool is first used)."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(workers))


# A document longer than this is encoded in pieces cut at line breaks: the tokenizer's per-token objects cost
# about a hundred bytes per token, so one 100 MB document took over 15 GB (and minutes) encoded whole.
PIECE_CHARS = 1 << 20
_PIECES_AT_ONCE = 8


class _Ids:
    """What ``_to_array`` reads of an encoding (its ids), for documents assembled from pieces: an array (4
    bytes a token where a list of ints costs about 36)."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids


# Where a piece may end: before a single space or line break that stands between two non-space characters.
# GPT-style pre-tokenizers (GPT-2's and Llama 3's patterns) always split there: a token never ends in such a
# space, and the next one starts with it, so the pieces' tokens are the whole text's. Elsewhere (a run of
# spaces, a line break after a blank line) a cut could change the tokens, so it is only the last resort.
_CUT = re.compile(r"(?<=\S)(?=[ \n]\S)")


def _cut_point(text: str, start: int, limit: int) -> int:
    """The end of the piece from ``start``: the last safe cut (``_CUT``) before ``start + limit``, else there."""
    end = start + limit
    for match in reversed(list(_CUT.finditer(text, start + 1, end))):
        return match.start()
    return end


def _cut(text: str, limit: int) -> List[str]:
    """``text`` in pieces of at most ``limit`` characters; the pieces joined are the text."""
    pieces, start = [], 0
    while len(text) - start > limit:
        end = _cut_point(text, start, limit)
        pieces.append(text[start:end])
        start = end
    return pieces + [text[start:]]


def _encode(encode, texts: List[str], add_special_tokens: bool) -> Tuple[list, int, int]:
    """Encodings of ``texts``, the count of texts whose lone surrogates were replaced, and of texts encoded
    in pieces (longer than PIECE_CHARS; a piece boundary can tokenize differently from the whole text, so
    they are counted). Special tokens, when asked for, go with a document's first piece."""
    fixed = 0
    if any(len(t) > PIECE_CHARS for t in texts):
        texts, fixed = replace_lone_surrogates(texts)
        out, long = [], 0
        for text in texts:
            if len(text) <= PIECE_CHARS:
                out += encode([text], add_special_tokens=add_special_tokens)
                continue
            long += 1
            pieces, ids = _cut(text, PIECE_CHARS), []
            for i in range(0, len(pieces), _PIECES_AT_ONCE):  # a few pieces' encodings alive at a time
                group = pieces[i:i + _PIECES_AT_ONCE]
                for k, encoding in enumerate(encode(group, add_special_tokens=False)):
                    first = add_special_tokens and i + k == 0
                    ids.append(np.asarray(encode([group[0]], add_special_tokens=True)[0].ids if first else encoding.ids,
                                          dtype=np.int32))
            out.append(_Ids(np.concatenate(ids)))
        return out, fixed, long
    try:
        return encode(texts, add_special_tokens=add_special_tokens), 0, 0
    except TypeError:  # a lone surrogate ("\ud800" in JSON) is not text the tokenizer takes
        texts, fixed = replace_lone_surrogates(texts)
        return encode(texts, add_special_tokens=add_special_tokens), fixed, 0


def replace_lone_surrogates(texts: List[str]) -> Tuple[List[str], int]:
    """Each text with its unpaired UTF-16 surrogates replaced by U+FFFD, and how many texts had one. A corpus
    of billions of documents is not failed for one bad escape; the summary counts them."""
    out, fixed = [], 0
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            fixed += 1
        out.append(text)
    return out, fixed


def _arrays_to_array(docs: List[np.ndarray], eod: Optional[int], dtype) -> tuple:
    tail = [np.asarray([eod], dtype=dtype)] if eod is not None else []
    kept = [d for d in docs if len(d)]
    flat = np.concatenate([part for d in kept for part in [d, *tail]]) if kept else np.zeros(0, dtype=dtype)
    lengths = np.asarray([len(d) + len(tail) for d in kept], dtype=np.int64)
    return flat, lengths, len(docs) - len(kept)


def _to_array(encodings, eod: Optional[int], dtype) -> tuple:
    """One batch's ids back to back (+EOD per non-empty document) and each document's length."""
    if any(isinstance(e, _Ids) for e in encodings):  # a pieced document: arrays, never a list of its ids
        return _arrays_to_array([np.asarray(e.ids, dtype=dtype) for e in encodings], eod, dtype)
    ids = [e.ids for e in encodings]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    keep = lengths > 0
    if eod is not None:
        for x in ids:
            if x:
                x.append(eod)
        lengths[keep] += 1
    flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths[keep], int(len(ids) - keep.sum())


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
    overwrite: bool = False,
    batch_bytes: int = 1 << 20,
) -> PreprocessSummary:
    """Tokenize every document (+ EOD) of the inputs, in order, into ``<output_prefix>.bin/.idx``."""
    from megatron_recipes.data.fast_tokenizer import load_preprocess_tokenizer
    from megatron_recipes.data.inputs import expand_inputs, input_format, iter_text_batches, plain_input_bytes
    from megatron_recipes.progress import Progress

    started = time.perf_counter()
    workers = workers or len(os.sched_getaffinity(0))
    if workers < 1:
        raise RecipeError(f"workers={workers}", fix="workers >= 1")
    check_output_prefix(output_prefix, overwrite)
    for path in expand_inputs(input_spec):  # every input checked before the tokenizer loads
        input_format(path)
    _set_threads(workers)
    tok = load_preprocess_tokenizer(tokenizer)
    out_dtype = token_dtype(tok.vocab_size, dtype)  # before any work: a too-narrow dtype is an error
    eod = tok.eod if append_eod else None
    remove_stale_temporaries(output_prefix)
    encode = tok.backend.encode_batch_fast if workers > 1 else (lambda texts, **kw: [tok.backend.encode(t, **kw) for t in texts])
    rows = missing = empty = invalid = pieced = 0
    bar = Progress("preprocess", total=plain_input_bytes(input_spec), unit="B", items_unit="documents",
                   enabled=show_progress)
    with bar, indexed_writer(output_prefix, out_dtype) as writer:
        for batch in _read_ahead(iter_text_batches(input_spec, text_key, split, batch_bytes, batch_size)):
            rows += batch.rows
            missing += batch.missing
            if batch.texts:
                encodings, fixed, cut = _encode(encode, batch.texts, add_special_tokens)
                invalid, pieced = invalid + fixed, pieced + cut
                flat, lengths, skipped = _to_array(encodings, eod, out_dtype)
                empty += skipped
                if len(lengths):
                    writer.add_batch(flat, lengths)
            bar.update(batch.nbytes, items=batch.rows - batch.missing)
        if writer.documents == 0:
            raise RecipeError(
                f"no document of '{input_spec}' has any token ({rows} rows: {empty} empty, {missing} without '{text_key}'); "
                "megatron-core cannot train on a 0-document dataset",
                fix=f"check text_key={text_key} and that the input holds text",
            )
    return PreprocessSummary(
        output_prefix=output_prefix,
        input_rows=rows,
        documents=writer.documents,
        empty=empty,
        missing=missing,
        tokens=writer.tokens,
        bytes=os.path.getsize(output_prefix + ".bin"),
        seconds=time.perf_counter() - started,
        tokenizer_via=tok.via,
        max_token_id=writer.max_token_id,
        invalid_unicode=invalid,
        pieced=pieced,
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
        ("tokenizer loaded via", summary.tokenizer_via),
        ("documents with lone surrogates (replaced by U+FFFD)", f"{summary.invalid_unicode:,}"),
        (f"documents over {PIECE_CHARS:,} characters (encoded in pieces)", f"{summary.pieced:,}"),
        ("tokens", f"{summary.tokens:,}"),
        ("largest token id", f"{summary.max_token_id:,}"),
        (".bin bytes", f"{summary.bytes:,}"),
        ("seconds", f"{summary.seconds:.2f}"),
        ("documents/s", f"{summary.docs_per_s:,.0f}"),
        ("tokens/s", f"{summary.tokens_per_s:,.0f}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console(stderr=True).print(table)
