"""`data preprocess`: every token equals direct tokenization + EOD, for every input kind; bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_support import small_builtin, stdlib_texts, write_jsonl

from megatron_recipes.cli import main as cli_main
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data.preprocess import preprocess


@pytest.fixture(scope="module")
def tok_dir(data_cache):
    return str(small_builtin(data_cache).tokenizer_dir)  # read only; built once per session (conftest.py)


@pytest.fixture(scope="module")
def texts():
    docs = stdlib_texts(300, start=100)
    docs[3] = ""  # an empty document: skipped and counted
    docs[10] = "caf\u00e9 \u2603 \U0001f600 na\u00efve"  # non-ASCII text survives byte-level BPE
    return docs


def expected_stream(tok_dir: str, docs, eod: bool = True):
    """Direct tokenization, document by document, the definition the .bin must match."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    out = []
    for text in docs:
        ids = hf(text or "", add_special_tokens=False)["input_ids"]
        if ids:
            out.append(ids + ([hf.eos_token_id] if eod else []))
    return out


def read_back(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == list(range(len(ds) + 1))  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def test_jsonl_exact_via_cli(tmp_path, tok_dir, texts, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"text": t, "n": i} for i, t in enumerate(texts)])
    rc = cli_main(["data", "preprocess", f"input={tmp_path / 'in.jsonl'}", f"output_prefix={tmp_path / 'out/c'}",
                   f"tokenizer={tok_dir}", "workers=2", "--quiet", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = expected_stream(tok_dir, texts)
    assert read_back(str(tmp_path / "out/c")) == want
    assert summary["documents"] == len(want) == len(texts) - 1 and summary["empty"] == 1
    assert summary["tokens"] == sum(map(len, want)) and summary["bytes"] == 2 * summary["tokens"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c.bin", "c.idx", "c.stats.json"]  # no scratch left
    stats = json.loads((tmp_path / "out" / "c.stats.json").read_text())  # what training checks against the vocab
    assert stats["max_token_id"] == summary["max_token_id"] == max(max(doc) for doc in want)
    assert stats["tokens"] == summary["tokens"] and stats["bin_size"] == summary["bytes"]


def test_parquet_csv_and_globs_in_order(tmp_path, tok_dir, texts):
    import pandas as pd

    a, b, c = texts[:100], texts[100:200], texts[200:]
    pd.DataFrame({"body": a, "x": range(len(a))}).to_parquet(tmp_path / "p1.parquet")
    pd.DataFrame({"body": b}).to_csv(tmp_path / "p2.csv", index=False)
    write_jsonl(tmp_path / "p3.jsonl", [{"body": t} for t in c])
    s = preprocess(f"{tmp_path}/p1.parquet,{tmp_path}/p2.csv,{tmp_path}/p3.jsonl", str(tmp_path / "mix"), tok_dir,
                   text_key="body", workers=1, show_progress=False)
    want = expected_stream(tok_dir, a + b + c)
    assert read_back(str(tmp_path / "mix")) == want and s.documents == len(want)
    # a glob expands in sorted order: p1.parquet, then p2, p3 written as parquet too
    pd.DataFrame({"body": b}).to_parquet(tmp_path / "p2.parquet")
    pd.DataFrame({"body": c}).to_parquet(tmp_path / "p3.parquet")
    preprocess(f"{tmp_path}/p*.parquet", str(tmp_path / "glob"), tok_dir, text_key="body", workers=2, show_progress=False)
    assert read_back(str(tmp_path / "glob")) == want


def test_saved_datasets_folder_and_no_eod(tmp_path, tok_dir, texts):
    from datasets import Dataset, DatasetDict

    Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    preprocess(str(tmp_path / "saved"), str(tmp_path / "d"), tok_dir, workers=2, batch_size=64, show_progress=False)
    assert read_back(str(tmp_path / "d")) == expected_stream(tok_dir, texts)
    DatasetDict({"train": Dataset.from_dict({"text": texts[:50]}), "test": Dataset.from_dict({"text": texts[50:60]})}).save_to_disk(
        str(tmp_path / "dd")
    )
    preprocess(str(tmp_path / "dd"), str(tmp_path / "e"), tok_dir, split="test", append_eod=False, show_progress=False)
    assert read_back(str(tmp_path / "e")) == expected_stream(tok_dir, texts[50:60], eod=False)


def test_large_vocab_uses_int32(tmp_path):
    """ids above 65535 need int32: dtype=auto picks it, dtype=uint16 is refused before any work."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"], vocab["<eos>"] = 70000, 70001
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]").save_pretrained(str(tmp_path / "big"))
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{i}" for i in rng.integers(0, 70000, size=int(rng.integers(1, 50)))) for _ in range(200)]
    write_jsonl(tmp_path / "big.jsonl", [{"text": d} for d in docs])
    with pytest.raises(RecipeError, match="dtype=uint16 holds token ids up to 65535"):
        preprocess(str(tmp_path / "big.jsonl"), str(tmp_path / "o16"), str(tmp_path / "big"), dtype="uint16", show_progress=False)
    assert not list(tmp_path.glob("o16*"))
    s = preprocess(str(tmp_path / "big.jsonl"), str(tmp_path / "o"), str(tmp_path / "big"), workers=2, show_progress=False)
    got = read_back(str(tmp_path / "o"))
    assert got == expected_stream(str(tmp_path / "big"), docs) and max(max(d) for d in got) > 65535
    assert s.bytes == 4 * s.tokens


def test_bad_inputs(tmp_path, tok_dir):
    write_jsonl(tmp_path / "ok.jsonl", [{"content": "hello"}])
    with pytest.raises(RecipeError, match="no field 'text' \\(fields: content\\)"):
        preprocess(str(tmp_path / "ok.jsonl"), str(tmp_path / "o"), tok_dir, show_progress=False)
    with pytest.raises(RecipeError, match="tokenizer directory .* does not exist"):
        preprocess(str(tmp_path / "ok.jsonl"), str(tmp_path / "o"), str(tmp_path / "nope"), show_progress=False)
    with pytest.raises(RecipeError, match="does not exist"):
        preprocess(str(tmp_path / "absent.jsonl"), str(tmp_path / "o"), tok_dir, show_progress=False)
    with pytest.raises(RecipeError, match="matches no file"):
        preprocess(str(tmp_path / "*.parquet"), str(tmp_path / "o"), tok_dir, show_progress=False)
    with pytest.raises(RecipeError, match="unknown format"):
        (tmp_path / "x.txt").write_text("hi")
        preprocess(str(tmp_path / "x.txt"), str(tmp_path / "o"), tok_dir, show_progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 latin-1"}\n')
    with pytest.raises(RecipeError, match="line 2: bytes that are not UTF-8"):
        preprocess(str(bad), str(tmp_path / "o"), tok_dir, show_progress=False)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(RecipeError, match="line 2: invalid JSON"):
        preprocess(str(tmp_path / "broken.jsonl"), str(tmp_path / "o"), tok_dir, show_progress=False)
    write_jsonl(tmp_path / "nums.jsonl", [{"text": 5}, {"text": 6}])
    with pytest.raises(RecipeError, match="not text"):
        preprocess(str(tmp_path / "nums.jsonl"), str(tmp_path / "o"), tok_dir, show_progress=False)
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".o.*"))
    # rows without the field are skipped and counted
    write_jsonl(tmp_path / "holes.jsonl", [{"text": "a b"}, {"other": 1}, {"text": ""}, {"text": "c"}])
    s = preprocess(str(tmp_path / "holes.jsonl"), str(tmp_path / "h"), tok_dir, show_progress=False)
    assert (s.input_rows, s.documents, s.missing, s.empty) == (4, 2, 1, 1)
    assert cli_main(["data", "preprocess", "input=a.jsonl", "output_prefix=o", "tokenizer=t", "colour=red"]) == 2


def test_failed_run_keeps_previous_output_intact(tmp_path, tok_dir, texts, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    prefix = str(tmp_path / "out")
    preprocess(str(tmp_path / "in.jsonl"), prefix, tok_dir, workers=1, batch_bytes=4096, show_progress=False)
    before = {e: Path(prefix + e).read_bytes() for e in (".bin", ".idx", ".stats.json")}
    from megatron_recipes.data.idx_writer import IndexedWriter

    calls = {"n": 0}
    real = IndexedWriter.add_batch

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt("stopped half-way")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(IndexedWriter, "add_batch", failing)
    with pytest.raises(KeyboardInterrupt):
        preprocess(str(tmp_path / "in.jsonl"), prefix, tok_dir, workers=1, batch_bytes=4096, overwrite=True,
                   show_progress=False)
    assert calls["n"] > 5
    assert {e: Path(prefix + e).read_bytes() for e in (".bin", ".idx", ".stats.json")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.bin", "out.idx", "out.stats.json"]


_SLOW_RUN = """
import sys, time
from megatron_recipes.data import preprocess as p
real = p._to_array
def slow(*args):
    print("STARTED", flush=True)
    time.sleep(30)
    return real(*args)
p._to_array = slow
p.preprocess(sys.argv[1], sys.argv[2], sys.argv[3], workers=1, show_progress=False)
"""


def test_killed_run_leaves_nothing_that_looks_complete(tmp_path, tok_dir, texts):
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:20]])
    prefix = str(tmp_path / "out" / "c")
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_RUN, str(tmp_path / "in.jsonl"), prefix, tok_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 240
    while "STARTED" not in proc.stdout.readline():
        assert time.time() < deadline and proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert not IndexedDataset.exists(prefix)
    leftovers = list((tmp_path / "out").iterdir())
    assert leftovers and all(p.name.startswith(("c.bin.tmp-", "c.idx.tmp-")) for p in leftovers)
    preprocess(str(tmp_path / "in.jsonl"), prefix, tok_dir, workers=1, show_progress=False)  # next run cleans up
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c.bin", "c.idx", "c.stats.json"]
    assert read_back(prefix) == expected_stream(tok_dir, texts[:20])


def test_data_cli_dispatch(tmp_path, capsys):
    assert cli_main(["data"]) == 0 and "preprocess" in capsys.readouterr().out
    assert cli_main(["data", "shuffle"]) == 2 and "unknown data command 'shuffle'" in capsys.readouterr().err
    assert cli_main(["data", "preprocess", "input=a.jsonl"]) == 2
    assert "missing required option 'output_prefix='" in capsys.readouterr().err
    assert cli_main(["data", "preprocess", "input=a", "output_prefix=o", "tokenizer=t", "workers=two"]) == 2
    assert "workers=two is not an integer" in capsys.readouterr().err


def test_a_giant_document_is_encoded_in_pieces_with_the_same_tokens(tmp_path, tok_dir, texts, monkeypatch):
    # Before: one 100 MB document ran past 8 minutes and 15.6 GB without finishing (issue 30, case 14); measured
    # after: 31 s and 1.6 GB. Here the piece size is shrunk so a small document is cut into many pieces.
    import megatron_recipes.data.preprocess as pre

    monkeypatch.setattr(pre, "PIECE_CHARS", 2000)
    giant = "\n".join(texts)  # lines of Python source: cut at line breaks, as a byte-level BPE splits them anyway
    assert len(giant) > 20 * pre.PIECE_CHARS
    docs = ["a short document", giant, "def another(short): pass"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in docs])
    summary = preprocess(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), tok_dir, workers=2, show_progress=False)
    assert summary.pieced == 1 and summary.documents == 3
    assert read_back(str(tmp_path / "out")) == expected_stream(tok_dir, docs)
    pieces = pre._cut(giant, pre.PIECE_CHARS)
    assert "".join(pieces) == giant and max(map(len, pieces)) <= pre.PIECE_CHARS and len(pieces) > 20
