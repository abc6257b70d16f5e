"""Real training data with no downloads: this Python installation's standard-library sources.

The corpus (one document per ``.py`` file, in sorted path order), a byte-level BPE tokenizer trained on
it and the megatron-core ``.bin/.idx`` files are built once per input set and cached; every later call,
from any rank or process, reuses them (see ``cache.build_once`` for the locking and atomic publish).
"""

from __future__ import annotations

import json
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from megatron_recipes.config.schema import DataConfig, RunConfig
from megatron_recipes.data import artifact_cache as cache

FORMAT_VERSION = 2  # 2: the chat template's turn markers are special tokens
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TEMPLATE = "chatml"  # so apply_chat_template works with the built-in tokenizer too
# chatml's turn markers, one id each (as in every chat tokenizer): an answer then ends at one token, so an
# export's generation_config ends it by eos id alone, which transformers' generate, lm-eval and servers
# honour without being handed the tokenizer (stop strings need it)
TURN_TOKENS = ["<|im_start|>", "<|im_end|>"]
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3"}


@dataclass(frozen=True)
class BuiltinData:
    """The cached built-in corpus: tokenizer folder, indexed dataset prefix and corpus statistics."""

    tokenizer_dir: Path
    prefix: str
    num_documents: int
    num_tokens: int
    unigram_entropy_nats: float


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_sources(max_files: int) -> List[Path]:
    """The first ``max_files`` standard-library ``.py`` files in sorted relative-path order.

    Third-party packages and the (large, oddly encoded) test suites are skipped, so the corpus depends
    only on the Python version.
    """
    root = stdlib_dir()
    found: List[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        rel = os.path.relpath(folder, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return [root / rel for rel in sorted(found)[: max(0, max_files)]]


def _read_documents(files: List[Path]) -> List[str]:
    """UTF-8 text of each non-empty file; files that do not decode are skipped (deterministically)."""
    docs = []
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            docs.append(text)
    return docs


def _train_tokenizer(docs: List[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE (GPT-2 style) with EOD, pad and chat-turn specials, saved as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_recipes.data.sft.templates import template_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, PAD_TOKEN, *TURN_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer, length=len(docs))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD_TOKEN, pad_token=PAD_TOKEN,
                                 additional_special_tokens=TURN_TOKENS)
    hf.chat_template = template_text(CHAT_TEMPLATE)
    hf.save_pretrained(str(out_dir))
    return tok


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of the token frequency distribution: the loss of a model that ignores context."""
    p = counts[counts > 0].astype(np.float64)
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


def _write_indexed(tok, docs: List[str], prefix: str, vocab_size: int) -> Tuple[int, int, float]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_recipes.data.indexed import token_dtype

    eod = tok.token_to_id(EOD_TOKEN)
    dtype = token_dtype(vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    from megatron_recipes.progress import Progress

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    num_tokens = 0
    with Progress("built-in corpus: tokenizing", total=len(docs), unit="documents") as bar:
        for start in range(0, len(docs), 64):
            chunk = docs[start: start + 64]
            for encoding in tok.encode_batch(chunk, add_special_tokens=False):
                ids = np.asarray(encoding.ids + [eod], dtype=dtype)
                builder.add_document(ids, [ids.size])
                counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
                num_tokens += int(ids.size)
            bar.update(len(chunk))
    builder.finalize(prefix + ".idx")
    return len(docs), num_tokens, unigram_entropy(counts)


def _inputs(data: DataConfig) -> Tuple[dict, List[Path]]:
    files = stdlib_sources(data.builtin_max_files)
    root = stdlib_dir()
    key = {
        "format_version": FORMAT_VERSION,
        "python": sys.version,
        "max_files": data.builtin_max_files,
        "vocab_size": data.builtin_vocab_size,
        "files": [[str(p.relative_to(root)), p.stat().st_size] for p in files],
    }
    return key, files


def builtin_data_for(data: Optional[DataConfig] = None, build_missing: bool = True) -> Optional[BuiltinData]:
    """``ensure_builtin_data`` for a ``DataConfig`` alone (defaults when None), e.g. for the CLI; with
    ``build_missing=False``, None when it is not in the cache (an export does not rebuild a corpus)."""
    data = data if data is not None else DataConfig()
    key, files = _inputs(data)
    final = cache.cache_root(data.cache_dir) / "builtin" / cache.content_key(key)
    if not build_missing and cache.read_marker(final) is None:
        return None

    def build(tmp: Path) -> dict:
        docs = _read_documents(files)
        print(f"built-in corpus: building it once into {final.parent} ({len(docs)} standard-library files; its "
              f"tokenizer first, a byte-level BPE of {data.builtin_vocab_size} tokens)", file=sys.stderr, flush=True)
        tok = _train_tokenizer(docs, data.builtin_vocab_size, tmp / "tokenizer")
        n_docs, n_tokens, entropy = _write_indexed(tok, docs, str(tmp / "corpus"), data.builtin_vocab_size)
        return {
            "format_version": FORMAT_VERSION,
            "python": sys.version.split()[0],
            "num_files": len(files),
            "num_documents": n_docs,
            "num_tokens": n_tokens,
            "unigram_entropy_nats": entropy,
            "vocab_size": data.builtin_vocab_size,
            "inputs": key,
            "built_by_pid": os.getpid(),
        }

    manifest = cache.build_once(final, build)
    return BuiltinData(
        tokenizer_dir=final / "tokenizer",
        prefix=str(final / "corpus"),
        num_documents=int(manifest["num_documents"]),
        num_tokens=int(manifest["num_tokens"]),
        unigram_entropy_nats=float(manifest["unigram_entropy_nats"]),
    )


def cached_tokenizer_dirs(data: DataConfig) -> List[Path]:
    """Every built-in tokenizer in the data cache, the builds of earlier versions or settings included
    (a checkpoint names the one it trained with by content hash)."""
    root = cache.cache_root(data.cache_dir) / "builtin"
    return sorted(p / "tokenizer" for p in root.iterdir() if (p / "tokenizer" / "tokenizer.json").is_file()) if root.is_dir() else []


def ensure_builtin_data(cfg: RunConfig) -> BuiltinData:
    """Build (once, under a lock) or reuse the built-in corpus, tokenizer and indexed dataset."""
    return builtin_data_for(cfg.data)


def describe(data: BuiltinData) -> str:
    return json.dumps(
        {
            "prefix": data.prefix,
            "tokenizer_dir": str(data.tokenizer_dir),
            "documents": data.num_documents,
            "tokens": data.num_tokens,
            "unigram_entropy_nats": round(data.unigram_entropy_nats, 4),
            "unigram_entropy_bits": round(data.unigram_entropy_nats / math.log(2), 4),
        }
    )
