"""Micro-batches for one data-parallel rank, resumable exactly from ``consumed_samples``.

Samples are taken in one global order; each step of ``micro_batch_size * dp_size`` samples is cut into
DP slices (Megatron's pretraining sampler). The position in that order is the only state, so a trainer
that saves ``consumed_samples`` in its checkpoint gets bit-identical batches after a resume.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Sampler

from megatron_recipes.config.errors import RecipeError

# key -> dtype of what the trainer receives; segment_ids only exists for packed (SFT) data
BATCH_DTYPES = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
    "segment_ids": torch.int32,
}


class GlobalOrderSampler(Sampler[List[int]]):
    """Index lists for one DP rank: the rank's slice of every global micro-batch, from a start sample."""

    def __init__(
        self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0, cycle: bool = False
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise RecipeError(
                f"bad batch layout: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}",
                fix="micro_batch_size >= 1 and 0 <= dp_rank < dp_size",
            )
        if num_samples < 1:
            raise RecipeError("the dataset holds no samples", fix="check data.split and the data itself")
        if consumed_samples < 0 or (consumed_samples > num_samples and not cycle):
            raise RecipeError(
                f"consumed_samples={consumed_samples} is outside the dataset ({num_samples} samples)",
                fix="resume with the recipe (train_iters, global_batch_size, data) the checkpoint was written with",
            )
        self.num_samples = num_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.cycle = cycle

    def __iter__(self) -> Iterator[List[int]]:
        step = self.mbs * self.dp_size
        start = self.consumed_samples
        while self.cycle or start + step <= self.num_samples:  # incomplete last step: dropped
            first = start + self.dp_rank * self.mbs
            yield [(first + i) % self.num_samples for i in range(self.mbs)]
            start += step

    def __len__(self) -> int:
        if self.cycle:
            raise TypeError("a cycling sampler has no length")
        return max(0, (self.num_samples - self.consumed_samples) // (self.mbs * self.dp_size))


def collate(samples: List[Dict]) -> Dict[str, torch.Tensor]:
    """Stack the keys the trainer uses, with fixed dtypes; other keys (e.g. ``dataset_id``) are dropped."""
    out = {}
    for key, dtype in BATCH_DTYPES.items():
        if key in samples[0]:
            out[key] = torch.stack([torch.as_tensor(s[key]) for s in samples]).to(dtype)
    missing = [k for k in ("tokens", "labels", "loss_mask", "position_ids") if k not in out]
    if missing:
        raise RecipeError(f"dataset samples lack {missing}", fix="use a dataset from megatron_recipes.data")
    return out


class MicroBatches:
    """Iterator of micro-batch dicts; ``consumed_samples`` is the global count after the last batch."""

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        num_workers: int = 0,
        cycle: bool = False,
        vocab_size: Optional[int] = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.sampler = GlobalOrderSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples, cycle)
        self.consumed_samples = consumed_samples
        self._step = micro_batch_size * dp_size
        loader = DataLoader(
            dataset,
            batch_sampler=self.sampler,
            num_workers=num_workers,
            collate_fn=collate,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
        )
        self._it = iter(loader)

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        batch = next(self._it)
        if self.vocab_size is not None:
            check_token_ids(batch, self.vocab_size, self.consumed_samples)
        self.consumed_samples += self._step
        return batch


def check_token_ids(batch: Dict[str, torch.Tensor], vocab_size: int, first_sample: int) -> None:
    """Every id must name a row of the model's vocabulary. Beyond it, TP=1 crashes in the embedding while
    TP>1 trains silently wrong (the vocab-parallel embedding zeroes ids outside every rank's range, the
    vocab-parallel loss ignores such labels). Checked on the host copy: one max per micro-batch, no sync."""
    for key in ("tokens", "labels"):
        ids = batch[key]
        top = int(ids.max()) if ids.numel() else -1
        if top >= vocab_size:
            count = int((ids >= vocab_size).sum())
            raise RecipeError(
                f"the data holds token id {top} (and {count} id(s) >= {vocab_size} in the {key} of the micro-batch "
                f"after sample {first_sample}), but model.vocab_size={vocab_size}: those tokens are not in the "
                "model's vocabulary",
                fix="preprocess the data with the tokenizer the model was built for (data.tokenizer), or set "
                "model.vocab_size to that tokenizer's vocabulary",
            )


def micro_batches(
    dataset, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0, num_workers: int = 0,
    cycle: bool = False, vocab_size: Optional[int] = None,
) -> MicroBatches:
    """Deterministic micro-batches for DP rank ``dp_rank`` of ``dp_size``, starting after ``consumed_samples``;
    with ``vocab_size``, a batch holding an id outside the vocabulary is an error."""
    return MicroBatches(dataset, micro_batch_size, dp_rank, dp_size, consumed_samples, num_workers, cycle, vocab_size)
