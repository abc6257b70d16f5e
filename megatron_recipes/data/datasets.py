"""The trainer's one call for data: (train, valid, test) datasets for any ``data.kind``.

``builtin``/``indexed``/``mock`` go through megatron-core's GPT datasets (``pretrain``); ``sft`` gives
packed (or padded) chat rows (``sft.dataset``). Either way every item is a dict of tensors that
``batches.micro_batches`` turns into micro-batches.
"""

from __future__ import annotations

from megatron_recipes.config.schema import RunConfig


def build_datasets(cfg: RunConfig, tokenizer):
    """(train, valid, test); valid/test may be None. Call on every rank after process groups exist."""
    if cfg.data.kind == "sft":
        from megatron_recipes.data.sft.dataset import build_sft_datasets

        train, valid, test, _ = build_sft_datasets(cfg, tokenizer)
        return train, valid, test
    from megatron_recipes.data.pretrain import build_pretrain_datasets

    return build_pretrain_datasets(cfg, tokenizer)
