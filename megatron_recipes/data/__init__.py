"""Data: the built-in corpus, tokenizers, preprocessing to megatron-core indexed datasets, pretraining
datasets and blends, SFT chat data with packing, and the micro-batch iterator the trainer reads.

Import the submodules directly (``megatron_recipes.data.builtin`` ...); this package imports nothing
heavy on its own.
"""
