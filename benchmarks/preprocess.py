"""Throughput of `megatron-recipes data preprocess` vs a plain one-process-per-worker loop.

The baseline is what Megatron-LM's ``tools/preprocess_data.py`` does: a ``multiprocessing.Pool``
whose workers parse one JSON line and tokenize one document at a time, and a main process that
appends each document to megatron-core's ``IndexedDatasetBuilder``. Both runs use the same corpus
(JSON lines built from this machine's Python sources, no downloads), the same tokenizer and the same
number of workers; their outputs must be byte-identical. Prints both throughputs and the ratio.

    python benchmarks/preprocess.py [--mb 60] [--workers N] [--tokenizer DIR|builtin] [--keep DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

_tokenizer = None
_eod = None


def build_corpus(path: Path, megabytes: float) -> int:
    """JSON lines of ~1-4 KB documents cut from the Python installation's sources, up to the size."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in root.rglob("*.py"))
    target, written, docs = megabytes * 1e6, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for name in files:
                try:
                    text = Path(name).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                chunk = []
                for para in text.split("\n\n"):
                    chunk.append(para)
                    if sum(map(len, chunk)) > 1000:
                        line = json.dumps({"text": "\n\n".join(chunk), "source": name}) + "\n"
                        out.write(line)
                        written, docs, chunk = written + len(line), docs + 1, []
                if written >= target:
                    break
    return docs


def _init_worker(tokenizer_dir: str) -> None:
    global _tokenizer, _eod
    from transformers import AutoTokenizer

    _tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    _eod = _tokenizer.eos_token_id


def _encode_line(line: str):
    text = json.loads(line)["text"]
    ids = _tokenizer(text, add_special_tokens=False)["input_ids"]
    if ids:
        ids.append(_eod)
    return ids, len(line)


def baseline(jsonl: Path, prefix: str, tokenizer_dir: str, workers: int, dtype) -> None:
    """Megatron-LM style: Pool.imap over lines (chunks of 32), main process appends document by document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    with open(jsonl, encoding="utf-8") as lines, mp.get_context("fork").Pool(
        workers, initializer=_init_worker, initargs=(tokenizer_dir,)
    ) as pool:
        for ids, _ in pool.imap(_encode_line, lines, 32):
            if ids:
                builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (pool workers): comparable on a busy machine."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=60.0, help="corpus size in MB (JSON lines)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tokenizer", default="builtin", help="HF tokenizer folder, or builtin")
    parser.add_argument("--keep", default=None, help="folder to keep the corpus and outputs in")
    args = parser.parse_args()

    from megatron_recipes.data.indexed import token_dtype
    from megatron_recipes.data.preprocess import preprocess
    from megatron_recipes.data.tokenizer import tokenizer_source

    work = Path(args.keep or tempfile.mkdtemp(prefix="preprocess-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_source(args.tokenizer)
    corpus = work / "corpus.jsonl"
    if not corpus.exists():
        docs = build_corpus(corpus, args.mb)
        print(f"corpus: {corpus} {corpus.stat().st_size / 1e6:.1f} MB, {docs:,} documents", flush=True)
    size_mb = corpus.stat().st_size / 1e6
    dtype = token_dtype(tok.vocab_size)
    print(f"tokenizer: {tok.source} ({tok.vocab_size} tokens); workers: {args.workers}", flush=True)

    t0, c0 = time.perf_counter(), cpu_seconds()
    baseline(corpus, str(work / "baseline"), tok.source, args.workers, dtype)
    t_base, c_base = time.perf_counter() - t0, cpu_seconds() - c0
    print(f"baseline (Pool + per-document loop): {t_base:7.2f} s  {size_mb / t_base:6.2f} MB/s  cpu {c_base:7.2f} s", flush=True)

    t0, c0 = time.perf_counter(), cpu_seconds()
    summary = preprocess(str(corpus), str(work / "ours"), tok.source, workers=args.workers, show_progress=False)
    t_ours, c_ours = time.perf_counter() - t0, cpu_seconds() - c0
    print(
        f"megatron-recipes data preprocess:    {t_ours:7.2f} s  {size_mb / t_ours:6.2f} MB/s  cpu {c_ours:7.2f} s  "
        f"({summary.tokens_per_s:,.0f} tokens/s, {summary.docs_per_s:,.0f} docs/s)",
        flush=True,
    )
    same = all(filecmp.cmp(str(work / f"baseline{e}"), str(work / f"ours{e}"), shallow=False) for e in (".bin", ".idx"))
    print(f"outputs byte-identical: {same}")
    print(f"throughput ratio (ours / baseline): {t_base / t_ours:.2f}x  (goal >= 1.5x)")
    print(f"cpu-time ratio (baseline / ours):   {c_base / c_ours:.2f}x  (the same comparison when other jobs share the cores)")
    print(f"machine load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
