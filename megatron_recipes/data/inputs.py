"""Local corpora -> bounded batches of document texts, in input order, streamed (never a whole file in memory).

Accepts JSON lines (``.jsonl``/``.json``/``.ndjson``), Parquet, CSV/TSV (also ``.gz``/``.bz2``/``.xz``/
``.zst``/``.lz4``), folders written by ``datasets.save_to_disk``, and comma-separated lists and globs of
these. Each reader imports only its own library (the stdlib ``json`` module, ``pyarrow``, ``datasets``).

The text field must be a string in every row that has it: a null, a number, a list or an object is
an error naming the file and its line (JSON) or row; a JSON line without the field is skipped and
counted. An input without any row is an error.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

from megatron_recipes.config.errors import RecipeError

_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
_ROW_FIX = "make every '{key}' value a string, or drop those rows"


@dataclass
class TextBatch:
    """Consecutive documents of one input; ``missing`` counts JSON lines without the field (skipped)."""

    texts: List[str]
    missing: int = 0
    rows: int = 0  # input rows this batch covers (documents + missing)
    nbytes: int = 0  # input bytes it consumed (JSON lines: the raw lines; other forms: the text's characters)


def expand_inputs(spec: str) -> List[str]:
    """Comma-separated paths and globs -> existing paths (globs sorted), in the order given."""
    paths: List[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if glob.has_magic(part):
            matched = sorted(glob.glob(os.path.expanduser(part)))
            if not matched:
                raise RecipeError(f"input glob '{part}' matches no file", fix="check the pattern (quote it in the shell)")
            paths += matched
        else:
            path = os.path.expanduser(part)
            if not os.path.exists(path):
                raise RecipeError(f"input '{part}' does not exist", fix="give existing files, folders or globs")
            paths.append(path)
    if not paths:
        raise RecipeError("no input given", fix="input=corpus.jsonl (or a list a.jsonl,b.parquet, or a glob)")
    return paths


def input_format(path: str) -> str:
    """``json``/``parquet``/``csv`` from the extension, or ``disk`` for a save_to_disk folder."""
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
            return "disk"
        raise RecipeError(
            f"input folder '{path}' is not a datasets.save_to_disk folder (no state.json / dataset_dict.json)",
            fix="pass the files inside it, e.g. input='folder/*.jsonl'",
        )
    suffix = Path(_strip_compression(path.lower())).suffix
    if suffix not in _FORMATS:
        raise RecipeError(
            f"input '{path}' has an unknown format '{suffix or '(none)'}'",
            fix=f"use {', '.join(sorted(_FORMATS))} files (optionally compressed) or a save_to_disk folder",
        )
    return _FORMATS[suffix]


def _strip_compression(name: str) -> str:
    for ext in _COMPRESSED:
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def _open_binary(path: str):
    """A binary file object, decompressing by extension."""
    lowered = path.lower()
    if lowered.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if lowered.endswith(".bz2"):
        import bz2

        return bz2.open(path, "rb")
    if lowered.endswith(".xz"):
        import lzma

        return lzma.open(path, "rb")
    if lowered.endswith((".zst", ".lz4")):
        import io

        import pyarrow as pa

        codec = "zstd" if lowered.endswith(".zst") else "lz4"
        return io.BufferedReader(pa.CompressedInputStream(pa.OSFile(path, "rb"), codec))
    return open(path, "rb", buffering=1 << 20)


def _kind(value) -> str:
    return "null" if value is None else {bool: "a boolean", int: "a number", float: "a number", list: "a list",
                                         dict: "an object"}.get(type(value), type(value).__name__)


def _bad_row(path: str, where: str, key: str, value) -> RecipeError:
    shown = json.dumps(value)[:60] if value is not None else "null"
    return RecipeError(
        f"input '{path}', {where}: field '{key}' is {_kind(value)} ({shown}), not text",
        fix=_ROW_FIX.format(key=key),
    )


def _json_lines(path: str, key: str, batch_bytes: int, max_docs: int) -> Iterator[TextBatch]:
    batch, size, missing, rows, with_key, first_fields, consumed = [], 0, 0, 0, 0, None, 0
    with _open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            consumed += len(raw)
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as exc:
                raise RecipeError(
                    f"input '{path}', line {number}: bytes that are not UTF-8 at column {exc.start + 1}",
                    fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or drop the bad rows",
                ) from None
            except json.JSONDecodeError as exc:
                if not raw.strip():
                    continue  # blank line
                if number == 1 and raw.lstrip().startswith(b"["):
                    raise RecipeError(
                        f"input '{path}' is one JSON array, not JSON lines",
                        fix="write one JSON object per line (e.g. jq -c '.[]' in.json > out.jsonl)",
                    ) from None
                raise RecipeError(
                    f"input '{path}', line {number}: invalid JSON ({exc.msg})",
                    fix="inputs must be valid UTF-8 JSON lines (one object per line)",
                ) from None
            if not isinstance(record, dict):
                raise RecipeError(f"input '{path}', line {number}: {_kind(record)}, not a JSON object",
                                  fix='write one object per line, e.g. {"text": "..."}')
            rows += 1
            first_fields = first_fields if first_fields is not None else list(record)
            if key not in record:
                missing += 1
                continue
            text = record[key]
            if not isinstance(text, str):
                raise _bad_row(path, f"line {number}", key, text)
            with_key += 1
            batch.append(text)
            size += len(text)
            if size >= batch_bytes or len(batch) >= max_docs:
                yield TextBatch(batch, missing, len(batch) + missing, consumed)
                batch, size, missing, consumed = [], 0, 0, 0
    if rows == 0:
        raise RecipeError(f"input '{path}' holds no rows (empty file)", fix="remove it from input=, or re-create it")
    if with_key == 0:
        raise RecipeError(
            f"input '{path}' has no field '{key}' (fields: {', '.join(first_fields) or 'none'})",
            fix=f"pass text_key=<one of {', '.join(first_fields)}>" if first_fields else "write objects with a text field",
        )
    if batch or missing:
        yield TextBatch(batch, missing, len(batch) + missing, consumed)


def _check_column(path: str, key: str, names: List[str], arrow_type) -> None:
    import pyarrow as pa

    if key not in names:
        raise RecipeError(
            f"input '{path}' has no field '{key}' (fields: {', '.join(names) or 'none'})",
            fix=f"pass text_key=<one of {', '.join(names)}>",
        )
    if not (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)):
        raise RecipeError(f"field '{key}' of '{path}' holds {arrow_type}, not text", fix="point text_key at a string field")


def _split_by_size(texts: List[str], batch_bytes: int) -> Iterator[TextBatch]:
    start, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= batch_bytes:
            yield TextBatch(texts[start : i + 1], 0, i + 1 - start, size)
            start, size = i + 1, 0
    if start < len(texts):
        yield TextBatch(texts[start:], 0, len(texts) - start, size)


def _arrow_batches(path: str, key: str, record_batches, batch_bytes: int, start_row: int = 0) -> Iterator[TextBatch]:
    """Arrow record batches of one string column -> TextBatch; a null names its row; bad UTF-8 too."""
    import pyarrow as pa
    import pyarrow.compute as pc

    row = start_row
    for rb in record_batches:
        column = rb.column(0) if isinstance(rb, pa.RecordBatch) else rb.column(key)
        if column.null_count:
            first = int(pc.index(pc.is_null(column), True).as_py())
            raise _bad_row(path, f"row {row + first + 1}", key, None)
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError:
            for i, raw in enumerate(column.cast(pa.binary()).to_pylist()):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise RecipeError(
                        f"input '{path}', row {row + i + 1}: field '{key}' holds bytes that are not UTF-8 "
                        f"(at byte {exc.start} of the value)",
                        fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or drop the bad rows",
                    ) from None
            raise
        row += len(texts)
        yield from _split_by_size(texts, batch_bytes)
    if row == start_row:
        raise RecipeError(f"input '{path}' holds no rows", fix="remove it from input=, or re-create it")


def _parquet(path: str, key: str, batch_bytes: int, max_docs: int) -> Iterator[TextBatch]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for non-Parquet bytes
        raise RecipeError(f"cannot read Parquet input '{path}': {exc}", fix="write it with pandas/pyarrow to_parquet") from None
    schema = reader.schema_arrow
    _check_column(path, key, schema.names, schema.field(key).type if key in schema.names else None)
    yield from _arrow_batches(path, key, reader.iter_batches(batch_size=max_docs, columns=[key]), batch_bytes)


def _csv(path: str, key: str, batch_bytes: int) -> Iterator[TextBatch]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    delimiter = "\t" if _strip_compression(path.lower()).endswith(".tsv") else ","
    try:
        reader = pcsv.open_csv(
            pa.input_stream(path, compression="detect"),
            read_options=pcsv.ReadOptions(block_size=1 << 22),
            parse_options=pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
            convert_options=pcsv.ConvertOptions(column_types={key: pa.string()}, check_utf8=False),
        )
    except Exception as exc:  # pyarrow's CSV errors (empty file, bad header)
        raise RecipeError(f"cannot read CSV input '{path}': {str(exc).splitlines()[0]}", fix="give a CSV file with a header row") from None
    _check_column(path, key, reader.schema.names, pa.string())
    yield from _arrow_batches(path, key, (rb.select([key]) for rb in reader), batch_bytes)


def _disk(path: str, key: str, split: Optional[str], batch_bytes: int, max_docs: int) -> Iterator[TextBatch]:
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(path)
    except Exception as exc:
        raise RecipeError(f"cannot load the datasets folder '{path}': {exc}", fix="write it with save_to_disk()") from None
    if isinstance(loaded, DatasetDict):
        names = list(loaded.keys())
        chosen = split or ("train" if "train" in names else (names[0] if len(names) == 1 else None))
        if chosen not in names:
            raise RecipeError(f"'{path}' holds splits {names}", fix=f"choose one with split={names[0]}")
        loaded = loaded[chosen]
    column_type = loaded.features.arrow_schema.field(key).type if key in loaded.column_names else None
    _check_column(path, key, loaded.column_names, column_type)
    ds = loaded.select_columns([key]).with_format("arrow")
    yield from _arrow_batches(path, key, ds.iter(batch_size=max_docs), batch_bytes)


def plain_input_bytes(spec: str) -> Optional[int]:
    """Total bytes of the inputs when every one is an uncompressed JSON-lines file (what progress can count
    exactly, for an ETA); None otherwise."""
    paths = expand_inputs(spec)
    if all(input_format(p) == "json" and _strip_compression(p.lower()) == p.lower() for p in paths):
        return sum(os.path.getsize(p) for p in paths)
    return None


def iter_text_batches(spec: str, key: str, split: Optional[str] = None, batch_bytes: int = 1 << 20,
                      max_docs: int = 1000) -> Iterator[TextBatch]:
    """Every input's documents in order, in batches of about ``batch_bytes`` characters (at most ``max_docs``)."""
    paths = expand_inputs(spec)
    formats = [input_format(p) for p in paths]  # every path checked before any work
    for path, fmt in zip(paths, formats):
        if fmt == "json":
            yield from _json_lines(path, key, batch_bytes, max_docs)
        elif fmt == "parquet":
            yield from _parquet(path, key, batch_bytes, max_docs)
        elif fmt == "csv":
            yield from _csv(path, key, batch_bytes)
        else:
            yield from _disk(path, key, split, batch_bytes, max_docs)
