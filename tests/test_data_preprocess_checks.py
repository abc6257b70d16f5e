"""`data preprocess`: megatron-core's exact format without importing it, the tokenizer it loads, and
one clear message (exit 2) for every bad input or output; index caches follow the data's content."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_support import one_rank_group, small_builtin, small_cfg, stdlib_texts, write_jsonl

from megatron_recipes.cli import main as cli_main
from megatron_recipes.data.preprocess import preprocess


@pytest.fixture(scope="module")
def tok_dir(data_cache):
    return str(small_builtin(data_cache).tokenizer_dir)  # read only; built once per session (conftest.py)


def _run(args, capsys):
    rc = cli_main(["data", "preprocess", *args, "--quiet"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_is_byte_identical_to_megatron_core_builder(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

    from megatron_recipes.data.idx_writer import DTYPE_CODES, indexed_writer, optimal_dtype, token_dtype

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=int(rng.integers(1, 300))).astype(dtype) for _ in range(200)]
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for doc in docs:
        builder.add_document(doc, [doc.size])
    builder.finalize(str(tmp_path / "ref.idx"))
    with indexed_writer(str(tmp_path / "ours"), dtype) as writer:
        for part in (docs[:7], docs[7:150], docs[150:]):
            writer.add_batch(np.concatenate(part), np.array([d.size for d in part]))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    back = IndexedDataset(str(tmp_path / "ours"))
    assert len(back) == len(docs) and all(np.array_equal(back[i], d) for i, d in enumerate(docs))
    assert all(DTYPE_CODES[t] == DType.code_from_dtype(t) for t in DTYPE_CODES)
    for vocab in (256, 8192, 65499, 65500, 70000, 200000):
        assert optimal_dtype(vocab) is DType.optimal_dtype(vocab) and token_dtype(vocab) is DType.optimal_dtype(vocab)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.bin", "ours.idx", "ours.stats.json", "ref.bin", "ref.idx"]


_IMPORTS = """
import sys
from megatron_recipes.cli import main
rc = main(["data", "preprocess", "input=" + sys.argv[1], "output_prefix=" + sys.argv[2], "tokenizer=" + sys.argv[3],
           "workers=2", "--quiet", "--json"])
heavy = sorted(m for m in ("torch", "transformers", "megatron.core", "datasets", "pandas") if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy}) if (json := __import__("json")) else "")
"""


def test_preprocess_imports_nothing_heavy(tmp_path, tok_dir):
    """Start-up: the command runs without torch, transformers, megatron-core, datasets or pandas."""
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in stdlib_texts(20)])
    done = subprocess.run([sys.executable, "-c", _IMPORTS, str(tmp_path / "in.jsonl"), str(tmp_path / "o"), tok_dir],
                          capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0, "heavy": []}, done.stderr[-2000:]


def test_tokenizer_json_path_and_transformers_path_agree(tmp_path, tok_dir):
    """A plain folder loads from tokenizer.json alone; a class transformers rebuilds goes through it."""
    from transformers import AutoTokenizer

    from megatron_recipes.data.fast_tokenizer import load_preprocess_tokenizer

    plain = load_preprocess_tokenizer(tok_dir)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert plain.via == "tokenizer.json" and plain.eod == hf.eos_token_id and plain.vocab_size == len(hf)
    other = tmp_path / "gpt2style"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((Path(tok_dir) / name).read_bytes())
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    via = load_preprocess_tokenizer(str(other))
    assert via.via.startswith("transformers (tokenizer_class=GPT2Tokenizer")
    text = "def f(x):\n    return x + 1  # caf\u00e9 \U0001f600"
    want = AutoTokenizer.from_pretrained(str(other))(text, add_special_tokens=False)["input_ids"]
    assert via.backend.encode(text, add_special_tokens=False).ids == want
    assert plain.backend.encode(text, add_special_tokens=False).ids == hf(text, add_special_tokens=False)["input_ids"]


def test_existing_prefix_needs_overwrite(tmp_path, tok_dir, capsys):
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in stdlib_texts(30)])
    write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in stdlib_texts(10, start=40)])
    args = [f"output_prefix={tmp_path / 'out'}", f"tokenizer={tok_dir}"]
    assert _run([f"input={tmp_path / 'a.jsonl'}", *args], capsys)[0] == 0
    before = (tmp_path / "out.idx").read_bytes()
    rc, err = _run([f"input={tmp_path / 'b.jsonl'}", *args], capsys)
    assert rc == 2 and "already holds a dataset" in err and "--overwrite" in err
    assert (tmp_path / "out.idx").read_bytes() == before
    assert _run([f"input={tmp_path / 'b.jsonl'}", *args, "--overwrite"], capsys)[0] == 0
    assert (tmp_path / "out.idx").read_bytes() != before


def test_overwrite_never_replaces_a_linked_dataset(tmp_path, tok_dir, capsys):
    # Before: --overwrite renamed the new .bin over a symlink (the user's link to shared data became a copy).
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in stdlib_texts(30)])
    args = [f"input={tmp_path / 'a.jsonl'}", f"tokenizer={tok_dir}"]
    assert _run([f"output_prefix={tmp_path / 'shared'}", *args], capsys)[0] == 0
    for ext in (".bin", ".idx"):
        (tmp_path / f"out{ext}").symlink_to(tmp_path / f"shared{ext}")
    rc, err = _run([f"output_prefix={tmp_path / 'out'}", *args, "--overwrite"], capsys)
    assert rc == 2 and "is a symbolic link" in err and "fix:" in err, err
    assert (tmp_path / "out.bin").is_symlink() and (tmp_path / "out.idx").is_symlink()


def test_bad_rows_name_their_line_or_row(tmp_path, tok_dir, capsys):
    import pandas as pd

    for value, kind in ((None, "null"), (7, "a number"), (["a", "b"], "a list")):
        rows = [{"text": "fine"}, {"text": "also fine"}, {"other": 1}, {"text": value}, {"text": "x"}]
        write_jsonl(tmp_path / "rows.jsonl", rows)
        rc, err = _run([f"input={tmp_path / 'rows.jsonl'}", f"output_prefix={tmp_path / 'o'}", f"tokenizer={tok_dir}"], capsys)
        assert rc == 2 and f"line 4: field 'text' is {kind}" in err and "fix:" in err and "Traceback" not in err
    pd.DataFrame({"text": ["a", "b", "c", None, "e"]}).to_parquet(tmp_path / "rows.parquet")
    rc, err = _run([f"input={tmp_path / 'rows.parquet'}", f"output_prefix={tmp_path / 'o'}", f"tokenizer={tok_dir}"], capsys)
    assert rc == 2 and "row 4: field 'text' is null" in err
    assert not list(tmp_path.glob("o.*"))


def test_empty_inputs_and_empty_documents_are_refused(tmp_path, tok_dir, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    common = [f"output_prefix={tmp_path / 'o'}", f"tokenizer={tok_dir}"]
    rc, err = _run([f"input={tmp_path / 'empty.jsonl'}", *common], capsys)
    assert rc == 2 and "empty.jsonl' holds no rows" in err and "StopIteration" not in err
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}, {"text": ""}])
    rc, err = _run([f"input={tmp_path / 'blank.jsonl'}", *common], capsys)
    assert rc == 2 and "no document" in err and "3 rows: 3 empty" in err and "0-document" in err
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob("o.*.tmp-*"))


def test_unwritable_output_prefix(tmp_path, tok_dir, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    (tmp_path / "a_file").write_text("not a folder")
    rc, err = _run([f"input={tmp_path / 'in.jsonl'}", f"output_prefix={tmp_path / 'a_file' / 'sub' / 'o'}",
                    f"tokenizer={tok_dir}"], capsys)
    assert rc == 2 and "cannot write output_prefix=" in err and "fix: choose an output_prefix" in err
    assert "Traceback" not in err


def test_index_cache_follows_content_not_path(tmp_path, tok_dir):
    """Re-preprocessing into the same prefix must not reuse the old dataset's document/sample indices."""
    from megatron_recipes.data.batches import micro_batches
    from megatron_recipes.data.pretrain import build_pretrain_datasets
    from megatron_recipes.data.tokenizer import load_tokenizer

    prefix = str(tmp_path / "data" / "corpus")
    cfg = small_cfg(tmp_path / "cache", "data=indexed", f"data.tokenizer={tok_dir}", f"data.blend=[{prefix}]",
                    "data.split='100,0,0'", "train.train_iters=3", "logging.eval_iters=0")
    write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in stdlib_texts(120)])
    write_jsonl(tmp_path / "small.jsonl", [{"text": t[:300]} for t in stdlib_texts(12, start=200)])
    preprocess(str(tmp_path / "big.jsonl"), prefix, tok_dir, show_progress=False)
    tokenizer = load_tokenizer(cfg)
    with one_rank_group():
        first = build_pretrain_datasets(cfg, tokenizer)[0]
        next(micro_batches(first, 2, 0, 1))
        preprocess(str(tmp_path / "small.jsonl"), prefix, tok_dir, show_progress=False, overwrite=True)
        second = build_pretrain_datasets(cfg, tokenizer)[0]
        seen = [second[i]["tokens"] for i in range(len(second))]  # the old indices point past the new data
    assert len(seen) == len(second) and first.dataset_path == second.dataset_path == prefix
    assert second.document_index.max() < 12
    assert len(list((tmp_path / "cache" / "index").iterdir())) == 2  # one cache folder per content


def test_progress_counts_documents_bytes_and_eta(tmp_path, tok_dir, monkeypatch, capsys):
    """Not on a terminal, preprocessing prints plain lines with documents, the share of input bytes and a rate."""
    from megatron_recipes import progress

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    texts = stdlib_texts(30)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    preprocess(str(tmp_path / "a.jsonl"), str(tmp_path / "out"), tok_dir, workers=1, batch_size=10)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("preprocess:")]
    size = (tmp_path / "a.jsonl").stat().st_size
    assert any("ETA" in line and "documents" in line for line in lines[:-1]), lines
    assert f"{len(texts):,} documents" in lines[-1] and progress.human(size, "B") in lines[-1], lines
