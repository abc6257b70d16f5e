"""megatron-core's GPT datasets with the loss mask of each sample its own.

megatron-core <= 0.16 (Megatron-LM issues 1269 and 1711): ``GPTDataset.__getitem__`` caches the first
sample's loss mask by reference and then zeroes that sample's pad-label positions in it in place, so every
later sample the process reads loses its loss at those positions too. Which sample a process reads first
depends on its data-parallel rank and on the step it resumed at, so the masks (and the training) changed
with the layout and on resume wherever the pad id occurs as a label (mock tokens cycle through the whole
vocabulary; real data holding the tokenizer's pad id; a short, padded last sample).

The classes keep megatron-core's names: the index caches are keyed on the class name, so caches written
before (``data build-index``) stay valid. Imported lazily (it imports megatron-core).
"""

from __future__ import annotations

from megatron.core.datasets import gpt_dataset


class _OwnLossMask:
    def __getitem__(self, idx):
        was_cached = self.masks_and_position_ids_are_cached
        sample = super().__getitem__(idx)
        if not was_cached and self.masks_and_position_ids_are_cached:
            # cacheable means no EOD masking and no resets: the clean mask is all ones
            self.cached_loss_mask = self.cached_loss_mask.new_ones(self.cached_loss_mask.shape)
        return sample


class GPTDataset(_OwnLossMask, gpt_dataset.GPTDataset):
    """megatron-core's GPTDataset; every sample's loss mask masks only its own pad labels."""


class MockGPTDataset(_OwnLossMask, gpt_dataset.MockGPTDataset):
    """megatron-core's MockGPTDataset; every sample's loss mask masks only its own pad labels."""
