"""SFT datasets: tokenized once per (file, tokenizer, template) into the cache, packed per run.

Tokenized conversations are cached like the built-in corpus (one builder under a lock, atomic
publish), so every rank of a job reads the same arrays instead of re-rendering the file. Overlong
samples are truncated or dropped by ``data.overlong_policy``; samples left with no answer token are
dropped; all of it is counted in ``SFTSummary``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

from megatron_recipes.config.errors import RecipeError
from megatron_recipes.config.schema import RunConfig
from megatron_recipes.data import artifact_cache as cache
from megatron_recipes.data.sft.formats import read_conversations
from megatron_recipes.data.sft.packing import assemble_row, first_fit_decreasing, pad_length
from megatron_recipes.data.sft.render import ChatRenderer, TokenizedSample
from megatron_recipes.data.sft.templates import resolve_template

FORMAT_VERSION = 2  # 2: per-turn weight 0 masks the turn; the marker counts empty answers
_BATCH = 512
log = logging.getLogger(__name__)


@dataclass
class SFTSummary:
    samples: int = 0  # conversations read
    kept: int = 0  # samples in the rows
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_answer: int = 0  # no loss token (none in the data, or all cut off by truncation)
    rows: int = 0
    tokens: int = 0  # input positions holding sample tokens
    loss_tokens: int = 0
    padding: int = 0
    empty_answers: int = 0  # assistant turns with no text: they teach only the end of turn
    weight_0_turns: int = 0  # assistant turns kept out of the loss by their weight 0

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.tokens + self.padding)

    def as_dict(self) -> dict:
        return {**asdict(self), "fill": round(self.fill, 4)}


def tokenize_file(path: str, tokenizer, template: str, answer_only: bool,
                  cache_dir: Optional[str]) -> Tuple[List[TokenizedSample], dict]:
    """Every conversation of a JSONL file as ids + answer mask (cached, built by one process), and the counts
    of empty answers and weight-0 turns."""
    stat = os.stat(path) if os.path.isfile(path) else None
    if stat is None:
        raise RecipeError(f"SFT file '{path}' does not exist", fix="set data.sft_path (and data.sft_valid_path) to JSONL files")
    key = {
        "format_version": FORMAT_VERSION,
        "file": os.path.abspath(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tokenizer": tokenizer.unique_identifiers["tokenizer_sha"],
        "template": hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "answer_only": answer_only,
    }
    final = cache.cache_root(cache_dir) / "sft" / cache.content_key(key)

    def build(tmp: Path) -> dict:
        renderer = ChatRenderer(tokenizer.hf, template, answer_only)
        samples: List[TokenizedSample] = []
        batch = []
        for item in read_conversations(path):
            batch.append(item)
            if len(batch) == _BATCH:
                samples += renderer.tokenize(batch)
                batch = []
        samples += renderer.tokenize(batch)
        lengths = np.array([len(s.ids) for s in samples], dtype=np.int64)
        np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]))
        np.save(tmp / "ids.npy", np.concatenate([s.ids for s in samples]) if samples else np.zeros(0, np.int32))
        np.save(tmp / "mask.npy", np.concatenate([s.mask for s in samples]) if samples else np.zeros(0, bool))
        return {"samples": len(samples), "inputs": key, **renderer.counts}

    marker = cache.build_once(final, build)
    offsets, ids, mask = (np.load(final / f"{n}.npy", mmap_mode="r") for n in ("offsets", "ids", "mask"))
    counts = {k: int(marker.get(k, 0)) for k in ("empty_answers", "weight_0_turns")}
    return [TokenizedSample(ids[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])], counts


def fit_to_length(samples: List[TokenizedSample], seq_length: int, policy: str, summary: SFTSummary) -> List[TokenizedSample]:
    """Apply the overlong policy (a sample fills len(ids) - 1 input positions) and drop answerless ones."""
    if policy not in ("truncate", "drop"):
        raise RecipeError(f"data.overlong_policy={policy}", fix="use truncate or drop")
    kept = []
    for sample in samples:
        summary.samples += 1
        if len(sample.ids) - 1 > seq_length:
            if policy == "drop":
                summary.dropped_overlong += 1
                continue
            sample = TokenizedSample(sample.ids[: seq_length + 1], sample.mask[: seq_length + 1])
            summary.truncated += 1
        if len(sample.ids) < 2 or not sample.mask[1:].any():
            summary.dropped_no_answer += 1
            continue
        kept.append(sample)
    return kept


class SFTDataset(torch.utils.data.Dataset):
    """Rows of whole samples (packed, or one per row), reshuffled every epoch, ``num_samples`` long."""

    def __init__(self, samples, rows: List[List[int]], seq_length: int, pad_id: int, pad_multiple: int,
                 packed: bool, seed: int, num_samples: Optional[int] = None) -> None:
        if not rows:
            raise RecipeError("no SFT sample is left to train on", fix="see the summary: too long (data.overlong_policy) or no answer")
        self.samples, self.rows = samples, rows
        self.seq_length, self.pad_id, self.pad_multiple = seq_length, pad_id, pad_multiple
        self.packed, self.seed = packed, seed
        self.num_samples = num_samples or len(rows)
        self._epoch_order = (-1, np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        """Row order of an epoch (the last one is kept: reads go through epochs in order)."""
        if self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(self.rows)))
        return self._epoch_order[1]

    def row(self, r: int) -> dict:
        """Row ``r`` in packing order (no shuffling)."""
        members = [self.samples[i] for i in self.rows[r]]
        return assemble_row(members, self.seq_length, self.pad_id, self.pad_multiple, self.packed)

    def __getitem__(self, idx: int) -> dict:
        epoch, j = divmod(int(idx), len(self.rows))
        return {k: torch.from_numpy(v) for k, v in self.row(int(self._order(epoch)[j])).items()}


def make_rows(samples: List[TokenizedSample], seq_length: int, pad_multiple: int, packed: bool, summary: SFTSummary) -> List[List[int]]:
    spans = [pad_length(len(s.ids) - 1, pad_multiple) for s in samples]
    if any(span > seq_length for span in spans):
        raise RecipeError(
            f"train.seq_length={seq_length} is not a multiple of {pad_multiple} (2 x context parallel size)",
            fix=f"use a seq_length divisible by {pad_multiple}",
        )
    rows = first_fit_decreasing(spans, seq_length) if packed else [[i] for i in range(len(samples))]
    summary.kept, summary.rows = len(samples), len(rows)
    summary.tokens = sum(len(s.ids) - 1 for s in samples)
    summary.loss_tokens = int(sum(int(s.mask[1:].sum()) for s in samples))
    summary.padding = len(rows) * seq_length - summary.tokens
    return rows


def sft_dataset(path: str, cfg: RunConfig, tokenizer, num_samples: Optional[int], seed_offset: int = 0) -> Tuple[SFTDataset, SFTSummary]:
    d = cfg.data
    template = resolve_template(d.chat_template, tokenizer.hf, tokenizer.source)
    samples, counts = tokenize_file(path, tokenizer, template, d.answer_only_loss, d.cache_dir)
    summary = SFTSummary(**counts)
    samples = fit_to_length(samples, cfg.train.seq_length, d.overlong_policy, summary)
    pad_multiple = 2 * cfg.parallel.cp if cfg.parallel.cp > 1 else 1
    rows = make_rows(samples, cfg.train.seq_length, pad_multiple, d.packing, summary)
    ds = SFTDataset(samples, rows, cfg.train.seq_length, tokenizer.pad_or_eod, pad_multiple, d.packing, cfg.seed + seed_offset, num_samples)
    return ds, summary


def build_sft_datasets(cfg: RunConfig, tokenizer):
    """(train, valid, None, {"train": summary, "valid": summary}) for ``data.kind=sft``."""
    from megatron_recipes.data.pretrain import dataset_sizes

    if not cfg.data.sft_path:
        raise RecipeError("data.kind=sft needs data.sft_path", fix="set data.sft_path=/path/to/train.jsonl")
    from megatron_recipes.data.sft.builtin_tasks import resolve_paths

    sizes = dataset_sizes(cfg)
    train_path, valid_path = resolve_paths(cfg.data.sft_path, cfg.data.sft_valid_path, cfg.data.cache_dir)
    train, train_summary = sft_dataset(train_path, cfg, tokenizer, sizes[0])
    summaries = {"train": train_summary}
    valid = None
    if valid_path and sizes[1]:
        valid, summaries["valid"] = sft_dataset(valid_path, cfg, tokenizer, sizes[1], seed_offset=1)
    _announce(summaries)
    return train, valid, None, summaries


def _announce(summaries: dict) -> None:
    """One line per split on rank 0; a warning (shown even without logging set up) if samples were cut."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for split, s in summaries.items():
        lossy = s.truncated or s.dropped_overlong or s.dropped_no_answer or s.empty_answers
        (log.warning if lossy else log.info)(
            "SFT %s: %d samples -> %d kept in %d rows (fill %.1f%%, %d loss tokens); truncated %d, dropped %d too long, "
            "%d without answer tokens; %d empty answers (trained as an immediate end of turn), %d turns with weight 0",
            split, s.samples, s.kept, s.rows, 100 * s.fill, s.loss_tokens, s.truncated, s.dropped_overlong, s.dropped_no_answer,
            s.empty_answers, s.weight_0_turns,
        )
