"""Local corpora -> one memory-mapped ``datasets.Dataset`` holding only the text column, in input order.

Accepts JSONL/JSON, Parquet, CSV/TSV files (also ``.gz``/``.zst``), folders written by
``datasets.save_to_disk``, and comma-separated lists and globs of these. Parsing is done by the
``datasets`` packaged builders (Arrow, multi-threaded C++), never line by line in Python.
"""

from __future__ import annotations

import glob
import json
import os
from itertools import groupby
from pathlib import Path
from typing import List, Optional, Tuple

from megatron_recipes.config.errors import RecipeError

_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_FORMATS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}


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
    name = path.lower()
    for ext in _COMPRESSED:
        if name.endswith(ext):
            name = name[: -len(ext)]
    suffix = Path(name).suffix
    if suffix not in _FORMATS:
        raise RecipeError(
            f"input '{path}' has an unknown format '{suffix or '(none)'}'",
            fix=f"use {', '.join(sorted(_FORMATS))} files (optionally compressed) or a save_to_disk folder",
        )
    return _FORMATS[suffix]


def _first_bad_json_line(path: str) -> Optional[str]:
    """Where a JSON-lines file stops being valid UTF-8 JSON (only called after a load fails)."""
    if path.lower().endswith(_COMPRESSED):
        return None
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"line {number}: bytes that are not UTF-8 at column {exc.start + 1}"
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    if number == 1:
                        return None  # maybe a single JSON document, not JSON lines
                    return f"line {number}: invalid JSON ({exc.msg})"
    return None


def _load_files(fmt: str, files: List[str], cache_dir: Path):
    from datasets import load_dataset

    kwargs = {"delimiter": "\t"} if fmt == "csv" and files[0].lower().split(".gz")[0].endswith(".tsv") else {}
    try:
        return load_dataset(fmt, data_files=files, split="train", cache_dir=str(cache_dir), **kwargs)
    except Exception as exc:  # datasets wraps the parser's error (pyarrow, pandas) in its own types
        where = ""
        if fmt == "json":
            for path in files:
                bad = _first_bad_json_line(path)
                if bad:
                    where = f" ({path}, {bad})"
                    break
        cause = exc.__cause__ or exc
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise RecipeError(
            f"cannot read {fmt} input{where}: {text}",
            fix="inputs must be valid UTF-8 " + ("JSON lines (one object per line)" if fmt == "json" else fmt),
        ) from None


def _load_disk(path: str, split: Optional[str]):
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
        return loaded[chosen]
    return loaded


def _check_utf8(ds, text_key: str, name: str, fmt: str) -> None:
    """Arrow's JSON/CSV readers keep invalid UTF-8 bytes in string columns; find them before tokenizing."""
    import pyarrow as pa

    row = 0
    for chunk in ds.data.table.column(text_key).chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid:
            for i, raw in enumerate(chunk.cast(pa.binary()).to_pylist()):
                try:
                    (raw or b"").decode("utf-8")
                except UnicodeDecodeError as exc:
                    where = f"row {row + i + 1}"
                    if fmt == "json":
                        first = next((b for b in map(_first_bad_json_line, name.split(", ")) if b), None)
                        where = first or where
                    raise RecipeError(
                        f"input '{name}', {where}: field '{text_key}' holds bytes that are not UTF-8 "
                        f"(at byte {exc.start} of the value)",
                        fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or drop the bad rows",
                    ) from None
        row += len(chunk)


def load_text_dataset(spec: str, text_key: str, cache_dir: Path, split: Optional[str] = None):
    """The text column of every input, concatenated in input order. Missing column -> RecipeError."""
    from datasets import Value, concatenate_datasets

    paths = expand_inputs(spec)
    groups: List[Tuple[str, List[str]]] = [(fmt, list(items)) for fmt, items in groupby(paths, key=input_format)]
    parts = []
    for fmt, files in groups:
        loaded = [_load_disk(f, split) for f in files] if fmt == "disk" else [_load_files(fmt, files, cache_dir)]
        for ds, name in zip(loaded, files if fmt == "disk" else [", ".join(files)]):
            if text_key not in ds.column_names:
                raise RecipeError(
                    f"input '{name}' has no field '{text_key}' (fields: {', '.join(ds.column_names) or 'none'})",
                    fix=f"pass text_key=<one of {', '.join(ds.column_names)}>",
                )
            ds = ds.select_columns([text_key])
            if ds.features[text_key] != Value("string"):
                if ds.features[text_key] not in (Value("large_string"), Value("null")):
                    raise RecipeError(
                        f"field '{text_key}' of '{name}' holds {ds.features[text_key]}, not text",
                        fix="point text_key at a string field",
                    )
                ds = ds.cast_column(text_key, Value("string"))
            if fmt != "disk":  # save_to_disk folders were written by Arrow from valid Python strings
                _check_utf8(ds, text_key, name, fmt)
            parts.append(ds)
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)
