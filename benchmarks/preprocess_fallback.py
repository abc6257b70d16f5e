"""Self-made FALLBACK baseline for benchmarks/preprocess.py when no Megatron-LM checkout is given.

It has the structure of Megatron-LM's ``tools/preprocess_data.py`` (a ``multiprocessing.Pool`` whose
workers parse one JSON line and tokenize one document with transformers, ``imap`` chunks of 32, the
main process appending each document to megatron-core's ``IndexedDatasetBuilder``), but it is not that
tool: its start-up and imports differ. Writes ``<prefix>_text_document.bin/.idx`` like the tool.

    python benchmarks/preprocess_fallback.py corpus.jsonl out/prefix tokenizer_dir workers
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys

_tokenizer = None


def _init_worker(tokenizer_dir: str) -> None:
    global _tokenizer
    from transformers import AutoTokenizer

    _tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, trust_remote_code=False)


def _encode_line(line: str):
    ids = _tokenizer(json.loads(line)["text"])["input_ids"]
    return ids + [_tokenizer.eos_token_id] if ids else ids


def main(corpus: str, prefix: str, tokenizer_dir: str, workers: str) -> int:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, trust_remote_code=False))
    builder = IndexedDatasetBuilder(prefix + "_text_document.bin", dtype=DType.optimal_dtype(vocab))
    with open(corpus, encoding="utf-8") as lines, mp.get_context("fork").Pool(
        int(workers), initializer=_init_worker, initargs=(tokenizer_dir,)
    ) as pool:
        for ids in pool.imap(_encode_line, lines, 32):
            if ids:
                builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + "_text_document.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
