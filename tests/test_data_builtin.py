"""The built-in corpus: exact tokens, cache reuse, one builder under concurrency, crash safety."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from data_support import small_builtin

from megatron_recipes.runtime import ranks
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.data import artifact_cache as cache


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    return root, small_builtin(root)


def test_tokens_round_trip_exactly(built):
    """Every document in the .bin equals tokenizing its source file with the saved HF tokenizer + EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    from megatron_recipes.data.builtin import _read_documents, stdlib_sources

    _, data = built
    hf = AutoTokenizer.from_pretrained(str(data.tokenizer_dir))
    docs = _read_documents(stdlib_sources(80))
    ds = IndexedDataset(data.prefix)
    assert len(ds) == len(docs) == data.num_documents > 40
    eod = hf.convert_tokens_to_ids("<|endoftext|>")
    assert hf.eos_token_id == eod and hf.pad_token_id not in (None, eod)
    total = 0
    for i, text in enumerate(docs):
        expected = hf(text, add_special_tokens=False)["input_ids"] + [eod]
        got = ds[i].tolist()
        assert got == expected, f"document {i} differs"
        assert hf.decode(got[:-1]) == text  # byte-level BPE is lossless
        total += len(got)
    assert total == data.num_tokens
    assert len(hf) <= 600


def test_unigram_entropy_matches_token_stream(built):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    _, data = built
    ds = IndexedDataset(data.prefix)
    stream = np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64)
    p = np.bincount(stream) / stream.size
    p = p[p > 0]
    assert data.unigram_entropy_nats == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    assert 3.0 < data.unigram_entropy_nats < np.log(600)


def test_second_call_reuses_the_cache(built):
    root, data = built
    manifest = Path(data.prefix).parent / cache.MARKER
    before = (manifest.stat().st_mtime_ns, Path(data.prefix + ".bin").stat().st_mtime_ns)
    t0 = time.perf_counter()
    again = small_builtin(root)
    assert time.perf_counter() - t0 < 2.0
    assert again == data
    assert (manifest.stat().st_mtime_ns, Path(data.prefix + ".bin").stat().st_mtime_ns) == before


def test_inputs_change_the_cache_key(built, tmp_path):
    from megatron_recipes.config.schema import DataConfig
    from megatron_recipes.data.builtin import _inputs

    key_a, _ = _inputs(DataConfig(builtin_max_files=80, builtin_vocab_size=600))
    key_b, _ = _inputs(DataConfig(builtin_max_files=80, builtin_vocab_size=601))
    key_c, _ = _inputs(DataConfig(builtin_max_files=81, builtin_vocab_size=600))
    assert len({cache.content_key(k) for k in (key_a, key_b, key_c)}) == 3


def _build_in_child(root: str, queue) -> None:
    data = small_builtin(Path(root))
    manifest = cache.read_marker(Path(data.prefix).parent)
    queue.put((os.getpid(), manifest["built_by_pid"], data.prefix))


@pytest.mark.slow
def test_concurrent_callers_build_once(tmp_path):
    ctx = ranks.context()  # separate processes, forked from the preloaded server
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    pids = {r[0] for r in results}
    builders = {r[1] for r in results}
    assert len(builders) == 1 and builders <= pids  # exactly one of them built, the others reused
    assert len({r[2] for r in results}) == 1
    leftovers = [p.name for p in (tmp_path / "builtin").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def _slow_build(final: str, started) -> None:
    def build(tmp: Path) -> dict:
        (tmp / "part.bin").write_bytes(b"x" * 100)
        started.set()
        time.sleep(60)
        return {"ok": True}

    cache.build_once(Path(final), build)


def test_killed_builder_leaves_nothing_that_looks_complete(tmp_path):
    final = tmp_path / "artefact"
    ctx = ranks.context()  # separate processes, forked from the preloaded server
    started = ctx.Event()
    proc = ctx.Process(target=_slow_build, args=(str(final), started))
    proc.start()
    assert started.wait(timeout=120)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert cache.read_marker(final) is None and not final.exists()
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())  # the half-built folder is only a temp name

    calls = []

    def build(tmp: Path) -> dict:
        calls.append(tmp)
        (tmp / "done.txt").write_text("ok")
        return {"value": 7}

    assert cache.build_once(final, build) == {"value": 7}
    assert cache.build_once(final, build) == {"value": 7}
    assert len(calls) == 1 and (final / "done.txt").read_text() == "ok"
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())  # stale temp folder cleaned


def test_folder_without_marker_is_rebuilt(tmp_path):
    final = tmp_path / "artefact"
    final.mkdir()
    (final / "junk").write_text("half")
    assert cache.build_once(final, lambda tmp: {"fresh": 1}) == {"fresh": 1}
    assert not (final / "junk").exists()


def test_tokenizer_errors(built, tmp_path):
    from megatron_recipes.data.tokenizer import check_fits_model, load_tokenizer, load_tokenizer_dir

    with pytest.raises(RecipeError, match="does not exist"):
        load_tokenizer_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="cannot load a tokenizer"):
        load_tokenizer_dir(tmp_path / "empty")

    root, data = built
    from data_support import small_cfg

    cfg = small_cfg(root, "model.vocab_size=512")
    with pytest.raises(RecipeError, match="model.vocab_size=512"):
        load_tokenizer(cfg)
    tok = load_tokenizer(small_cfg(root))
    assert tok.vocab_size == len(tok.hf) and tok.eod == tok.hf.eos_token_id and tok.pad != tok.eod
    check_fits_model(tok, small_cfg(root, f"model.vocab_size={tok.vocab_size}"))
